package awssqs

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"

	"github.com/custody-go/custody/internal/testkit/sqsemu"
)

// lostAnswerTransport lets the first ReceiveMessage reach SQS, drops its
// answer and reports a reset connection, so the SDK retries the call; it
// notes the ReceiveRequestAttemptId of every ReceiveMessage request.
type lostAnswerTransport struct {
	base     http.RoundTripper
	mu       sync.Mutex
	attempts []string
}

func (t *lostAnswerTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if !strings.HasSuffix(r.Header.Get("X-Amz-Target"), ".ReceiveMessage") {
		return t.base.RoundTrip(r)
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		return nil, err
	}
	r.Body.Close()
	var in struct{ ReceiveRequestAttemptId string }
	json.Unmarshal(body, &in)
	r.Body = io.NopCloser(bytes.NewReader(body))
	t.mu.Lock()
	t.attempts = append(t.attempts, in.ReceiveRequestAttemptId)
	first := len(t.attempts) == 1
	t.mu.Unlock()
	resp, err := t.base.RoundTrip(r)
	if err != nil || !first {
		return resp, err
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return nil, errors.New("read tcp 127.0.0.1: connection reset by peer")
}

// TestFIFORetriedReceiveGetsItsMessagesBack: when a ReceiveMessage answer is
// lost after SQS picked messages from a FIFO queue, the SDK retries the call.
// Without the same ReceiveRequestAttemptId on the retry, SQS picks afresh:
// the first pick's messages sit invisible for a whole visibility timeout,
// handed to no one, and block their message groups meanwhile. With it, SQS
// returns the same messages again. Every retry of a poll must carry the
// poll's id.
func TestFIFORetriedReceiveGetsItsMessagesBack(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	url, _ := e.queue(true, 30*time.Second, nil)
	e.send(url, "m", "g", nil)
	tr := &lostAnswerTransport{base: &http.Transport{}}
	client := sqs.New(sqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(sqsemu.Start(t)),
		Credentials:  credentials.NewStaticCredentialsProvider("fake", "fake", ""),
		HTTPClient:   &http.Client{Transport: tr},
	})
	src, err := New(e.ctx(), client, url, testOptions()...)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	// The emulator ignores the id, so the retry finds the queue empty; what
	// matters is what was asked.
	if _, err := src.Receive(e.ctx(), 1); err != nil {
		t.Fatal(err)
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	if len(tr.attempts) < 2 {
		t.Fatalf("%d ReceiveMessage requests; the SDK did not retry the lost answer", len(tr.attempts))
	}
	if tr.attempts[0] == "" || tr.attempts[1] != tr.attempts[0] {
		t.Errorf("ReceiveRequestAttemptId %q, then %q on the retry; want one id, kept across the retry", tr.attempts[0], tr.attempts[1])
	}
}
