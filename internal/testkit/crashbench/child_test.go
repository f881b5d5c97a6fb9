package crashbench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/consumer"
)

// The environment of a child: which consumer to be, and where its messages
// are.
const (
	envRole        = "CUSTODY_CRASHBENCH_CHILD" // "<broker>/<reader>", e.g. "sqs/custody"
	envAddr        = "CUSTODY_CRASHBENCH_ADDR"  // broker address or endpoint
	envQueue       = "CUSTODY_CRASHBENCH_QUEUE" // queue URL, queue name or topic
	envGroup       = "CUSTODY_CRASHBENCH_GROUP" // Kafka consumer group
	envWork        = "CUSTODY_CRASHBENCH_WORK"  // work per message, a time.Duration
	envConcurrency = "CUSTODY_CRASHBENCH_CONCURRENCY"
)

// effectsFD is the child's descriptor of the pipe it writes its effects to
// (the parent's exec.Cmd.ExtraFiles[0]).
const effectsFD = 3

// childConfig is what a child reads from its environment.
type childConfig struct {
	addr, queue, group string
	work               time.Duration
	concurrency        int
	logger             *slog.Logger
}

// readers maps a role to the consumer a child runs. Each runs until ctx
// ends (SIGTERM), handling every message with effect.
var readers = map[string]func(ctx context.Context, cfg childConfig, effect func(ctx context.Context, body []byte) error) error{
	"sqs/custody":      sqsCustody,
	"sqs/raw":          sqsRaw,
	"rabbitmq/custody": rabbitCustody,
	"rabbitmq/raw":     rabbitRaw,
	"kafka/custody":    kafkaCustody,
	"kafka/raw":        kafkaRaw,
}

// runChild is the child process: it runs the consumer role names until
// SIGTERM and returns the exit code.
func runChild(role string) int {
	run, ok := readers[role]
	if !ok {
		fmt.Fprintf(os.Stderr, "crashbench child: unknown role %q\n", role)
		return 2
	}
	cfg, err := readChildConfig()
	if err != nil {
		fmt.Fprintf(os.Stderr, "crashbench child: %v\n", err)
		return 2
	}
	pipe := os.NewFile(effectsFD, "effects")
	effect := func(ctx context.Context, body []byte) error {
		time.Sleep(cfg.work)
		// One write per effect: a pipe write of less than PIPE_BUF bytes
		// is atomic, and what is written stays readable when this process
		// is killed. Only after it may the message be acknowledged.
		line := make([]byte, len(body)+1)
		copy(line, body)
		line[len(body)] = '\n'
		_, err := pipe.Write(line)
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, effect); err != nil {
		fmt.Fprintf(os.Stderr, "crashbench child %s: %v\n", role, err)
		return 1
	}
	return 0
}

func readChildConfig() (childConfig, error) {
	cfg := childConfig{
		addr:   os.Getenv(envAddr),
		queue:  os.Getenv(envQueue),
		group:  os.Getenv(envGroup),
		logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	var err error
	if cfg.work, err = time.ParseDuration(os.Getenv(envWork)); err != nil {
		return cfg, fmt.Errorf("%s: %w", envWork, err)
	}
	if cfg.concurrency, err = strconv.Atoi(os.Getenv(envConcurrency)); err != nil || cfg.concurrency < 1 {
		return cfg, fmt.Errorf("%s=%q: want a positive number", envConcurrency, os.Getenv(envConcurrency))
	}
	return cfg, nil
}

// runCustody runs custody's consumer over src with the child's concurrency
// and default options otherwise.
func runCustody(ctx context.Context, src adapters.Source, cfg childConfig, effect func(context.Context, []byte) error) error {
	c, err := consumer.New(src, consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return effect(ctx, m.Body)
	}), consumer.WithConcurrency(cfg.concurrency), consumer.WithLogger(cfg.logger))
	if err != nil {
		src.Close()
		return err
	}
	return c.Run(ctx)
}
