package sqsemu

import (
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
)

// NewClient returns an SQS client for the emulator at endpoint, with fake
// credentials, whose requests go through counter (nil: not counted).
func NewClient(endpoint string, counter *Counter) *sqs.Client {
	transport := &http.Transport{
		// Benchmarks keep many long polls and batch calls in flight; the
		// default of two idle connections per host would churn connections.
		MaxIdleConns:        256,
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
	}
	var rt http.RoundTripper = transport
	if counter != nil {
		counter.Base = transport
		rt = counter
	}
	return sqs.New(sqs.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(endpoint),
		Credentials:  credentials.NewStaticCredentialsProvider("fake", "fake", ""),
		HTTPClient:   &http.Client{Transport: rt},
	})
}

// Counter is an http.RoundTripper that counts requests, in total and per SQS
// operation (from the X-Amz-Target header of the JSON protocol).
type Counter struct {
	// Base carries the requests; nil means http.DefaultTransport.
	Base http.RoundTripper

	total atomic.Int64
	mu    sync.Mutex
	byOp  map[string]int64
}

// RoundTrip counts the request and passes it on.
func (c *Counter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.total.Add(1)
	op := r.Header.Get("X-Amz-Target")
	if i := strings.LastIndexByte(op, '.'); i >= 0 {
		op = op[i+1:]
	}
	c.mu.Lock()
	if c.byOp == nil {
		c.byOp = make(map[string]int64)
	}
	c.byOp[op]++
	c.mu.Unlock()
	base := c.Base
	if base == nil {
		base = http.DefaultTransport
	}
	return base.RoundTrip(r)
}

// Total returns the number of requests so far.
func (c *Counter) Total() int64 { return c.total.Load() }

// Op returns the number of requests for one operation, such as
// "ChangeMessageVisibilityBatch".
func (c *Counter) Op(name string) int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.byOp[name]
}

// Reset sets every count back to zero.
func (c *Counter) Reset() {
	c.mu.Lock()
	c.byOp = nil
	c.total.Store(0)
	c.mu.Unlock()
}

var (
	queueSeq  atomic.Int64
	notQueued = regexp.MustCompile(`[^A-Za-z0-9_-]+`)
)

// QueueName returns a queue name unique within this test binary, derived
// from the test's name so queues are easy to recognise. SQS names are at most
// 80 characters of letters, digits, hyphens and underscores.
func QueueName(t testing.TB) string {
	name := notQueued.ReplaceAllString(t.Name(), "-")
	suffix := "-" + strconv.FormatInt(queueSeq.Add(1), 10)
	if max := 70 - len(suffix); len(name) > max {
		name = name[len(name)-max:]
	}
	return strings.Trim(name, "-") + suffix
}
