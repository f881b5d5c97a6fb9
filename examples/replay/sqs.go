package main

import (
	"context"
	"errors"
	"fmt"
	"io"

	awsconfig "github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/adapters/awssqs"
)

// openSQS opens the SQS dead-letter queue at -dlq, with the AWS SDK's
// default configuration (credential chain, region, AWS_ENDPOINT_URL_SQS).
func openSQS(ctx context.Context, cfg config, out io.Writer) (*destination, error) {
	if cfg.dlq == "" {
		return nil, errors.New("-dlq: give the dead-letter queue's URL (what CreateQueue or GetQueueUrl returns)")
	}
	awsCfg, err := awsconfig.LoadDefaultConfig(ctx)
	if err != nil {
		return nil, fmt.Errorf("loading the AWS configuration: %w", err)
	}
	r, err := awssqs.NewReplay(ctx, sqs.NewFromConfig(awsCfg), cfg.dlq,
		awssqs.WithReplayWaitTime(cfg.wait), awssqs.WithReplayHold(cfg.hold))
	if err != nil {
		return nil, err
	}
	return &destination{replayer: r, name: "SQS queue " + cfg.dlq}, nil
}
