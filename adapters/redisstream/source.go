package redisstream

import (
	"container/heap"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel"

	"github.com/custody-go/custody/adapters"
	"github.com/custody-go/custody/internal/option"
)

// Source consumes one stream through a consumer group. Create it with [New];
// the runtime (package consumer) drives it. Its methods are safe for
// concurrent use. Deliveries' Native value is a [redis.XMessage].
type Source struct {
	client   redis.UniversalClient
	stream   string
	group    string
	consumer string
	delays   string // sorted set of entries parked for a delay longer than the lease
	opts     options
	interval time.Duration // reclaim scans at least this often
	caps     adapters.Capabilities
	logger   *slog.Logger
	tel      *telemetry
	stats    counters
	conn     connTracker
	calls    sync.WaitGroup // renewals whose caller stopped waiting for them

	mu       sync.Mutex
	closed   bool
	cursor   string    // where the next XAUTOCLAIM scan starts
	nextScan time.Time // when the next scan is due
	scanning bool      // a Receive is scanning
	due      dueHeap   // entries this Source gave back, by when they fall due
	// gone holds the ids of held entries found deleted from the stream:
	// nothing is left to renew or give back, and no one else can be handed
	// them, so their handlers run on.
	gone map[string]struct{}
	// groupLost is when this Source last found the group missing: entries
	// received before it are no longer pending in the group it created
	// again.
	groupLost time.Time
	// gen counts the times this Source found the group missing and dealt
	// with it, so that two Receives finding it missing deal with it once.
	gen uint64
	// held is what the runtime holds of what this Source handed out: the
	// entries whose Signals a missing group loses. sweepAt is the size at
	// which hold next drops those the runtime lost by itself.
	held    map[*held]struct{}
	sweepAt int

	groupMu sync.Mutex // serializes the handling of a missing group
}

var (
	_ adapters.Source   = (*Source)(nil)
	_ adapters.Extender = (*Source)(nil)
)

// New returns a Source reading stream through the consumer group group. It
// checks the server (Redis 7.0 or later, for XAUTOCLAIM's report of deleted
// entries) and the group, creating it with [WithCreateGroup], so that a
// wrong address, stream or group fails here; ctx bounds those calls. The
// client is yours: Close does not close it.
func New(ctx context.Context, client redis.UniversalClient, stream, group string, opts ...Option) (*Source, error) {
	if client == nil {
		return nil, errors.New("redisstream.New: nil client; pass a go-redis client (redis.NewClient, redis.NewClusterClient)")
	}
	if stream == "" || group == "" {
		return nil, fmt.Errorf("redisstream.New(stream %q, group %q): name both the stream and the consumer group", stream, group)
	}
	o := defaultOptions()
	if err := option.Apply(&o, opts); err != nil {
		return nil, err
	}
	if o.reclaimInterval > o.lease {
		return nil, fmt.Errorf("redisstream.WithReclaimInterval(%v): longer than the lease (%v); entries of a dead consumer would wait that long past their lease", o.reclaimInterval, o.lease)
	}
	delays, ok := delaysKey(stream, group)
	if _, single := client.(*redis.Client); !ok && !single {
		return nil, fmt.Errorf("redisstream.New: stream %q has a '}' but no hash tag, so no key beside it can share its cluster slot; rename it, or give it a hash tag such as {%s}", stream, strings.ReplaceAll(stream, "}", ""))
	}
	if o.consumer == "" {
		o.consumer = uniqueConsumer()
	}
	if o.logger == nil {
		o.logger = slog.Default()
	}
	if o.meterProvider == nil {
		o.meterProvider = otel.GetMeterProvider()
	}
	s := &Source{
		client:   client,
		stream:   stream,
		group:    group,
		consumer: o.consumer,
		delays:   delays,
		opts:     o,
		interval: o.reclaimInterval,
		logger:   o.logger,
		cursor:   "0-0",
	}
	if s.interval == 0 {
		s.interval = min(DefaultReclaimInterval, o.lease/2)
	}
	s.caps = adapters.Capabilities{
		Name:             "redis:" + stream,
		System:           "redis",
		Lease:            o.lease,
		NackDelay:        true,
		CountsDeliveries: true,
		Ack:              adapters.Batching{MaxEntries: ackChunk, Linger: ackLinger, MaxCalls: ackCalls},
		Nack:             adapters.Batching{MaxEntries: maxScriptBatch},
		Extend:           adapters.Batching{MaxEntries: maxScriptBatch, MaxCalls: extendCalls},
	}
	if err := checkVersion(ctx, client); err != nil {
		return nil, err
	}
	if err := s.checkGroup(ctx); err != nil {
		return nil, err
	}
	s.conn.connected(time.Now())
	tel, err := newTelemetry(o.meterProvider, s)
	if err != nil {
		return nil, fmt.Errorf("redisstream.New: metrics: %w", err)
	}
	s.tel = tel
	if o.cleanup > 0 {
		s.cleanup(ctx, o.cleanup)
	}
	return s, nil
}

// How the runtime batches acks (see What the Source declares in the package
// documentation). The linger pays over a network, for a hand-off per call
// that a local Redis feels: BenchmarkAckLinger measures both. Nacks are
// retries and shutdown give-backs, rare or in bulk: the workers send them
// at once.
const (
	ackLinger = 500 * time.Microsecond
	ackCalls  = 4
)

// extendCalls bounds the renewal calls under way; with maxScriptBatch
// entries a call, several are needed only for thousands of leases due at
// once.
const extendCalls = 4

// maxScriptBatch bounds the entries of one renewal or give-back script
// call: large enough that a consumer holding a few hundred entries renews
// them in one call, small enough that the script (two commands per entry on
// the server) stays short.
const maxScriptBatch = 512

// uniqueConsumer returns a consumer name no other Source has: the host, the
// process and a random suffix.
func uniqueConsumer() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "custody"
	}
	return host + "-" + strconv.Itoa(os.Getpid()) + "-" + rand.Text()[:8]
}

// checkVersion fails unless the server is Redis 7.0 or later: older ones
// hand out deleted entries from XAUTOCLAIM and keep them pending for ever.
func checkVersion(ctx context.Context, client redis.UniversalClient) error {
	info, err := client.Info(ctx, "server").Result()
	if err != nil {
		return fmt.Errorf("redisstream: reaching the server (check the address and credentials): %w", err)
	}
	for _, line := range strings.Split(info, "\n") {
		v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:")
		if !ok {
			continue
		}
		major, _, _ := strings.Cut(v, ".")
		if n, err := strconv.Atoi(major); err == nil && n < 7 {
			return fmt.Errorf("redisstream: the server runs Redis %s; the adapter needs 7.0 or later (XAUTOCLAIM reporting entries deleted while pending)", v)
		}
		return nil
	}
	return nil // a server that does not say: let the commands tell
}

// checkGroup makes sure the group exists, creating it when allowed.
func (s *Source) checkGroup(ctx context.Context) error {
	sent := time.Now()
	groups, err := s.client.XInfoGroups(ctx, s.stream).Result()
	s.conn.observe(sent, err)
	if err != nil && !isNoSuchKey(err) {
		return fmt.Errorf("redisstream.New: reading the groups of stream %q: %w", s.stream, err)
	}
	for _, g := range groups {
		if g.Name == s.group {
			return nil
		}
	}
	if s.opts.createStart == "" {
		return fmt.Errorf("redisstream.New: stream %q has no consumer group %q; create it (XGROUP CREATE %s %s $ MKSTREAM) or pass WithCreateGroup", s.stream, s.group, s.stream, s.group)
	}
	return s.createGroup(ctx, s.opts.createStart)
}

// createGroup creates the group (and the stream) at start; a group created
// meanwhile by another consumer is no error.
func (s *Source) createGroup(ctx context.Context, start string) error {
	sent := time.Now()
	err := s.client.XGroupCreateMkStream(ctx, s.stream, s.group, start).Err()
	s.conn.observe(sent, err)
	if err != nil && !strings.HasPrefix(err.Error(), "BUSYGROUP") {
		return fmt.Errorf("redisstream: creating consumer group %q of stream %q: %w", s.group, s.stream, err)
	}
	return nil
}

func isNoSuchKey(err error) bool {
	return err != nil && strings.Contains(err.Error(), "no such key")
}

// isNoGroup reports whether err says the stream or its group does not exist.
func isNoGroup(err error) bool {
	return err != nil && strings.HasPrefix(err.Error(), "NOGROUP")
}

// Capabilities reports the lease, delayed redelivery (the idle time of a
// pending entry), the group's delivery count, and no order: a group hands
// one stream's entries to many consumers, and reclaims hand some out again
// later.
func (s *Source) Capabilities() adapters.Capabilities { return s.caps }

// Stream returns the name of the stream the Source reads.
func (s *Source) Stream() string { return s.stream }

// Group returns the name of the consumer group.
func (s *Source) Group() string { return s.group }

// Consumer returns this Source's consumer name in the group.
func (s *Source) Consumer() string { return s.consumer }

// Close stops the Source and, when it holds no pending entry, deletes its
// consumer name from the group (and, with WithConsumerCleanup, the names of
// other consumers long idle that hold none). Entries it still holds (not
// acked, not given back) stay pending under its name until another
// consumer's reclaim takes them once they have been idle for the lease. A
// Receive waiting in XREADGROUP returns when the read does (WithBlock) and
// gives back what it read. Close waits for renewals still on their way to
// the server whose caller stopped waiting (see Extend), which the client's
// ReadTimeout bounds. Close never closes the client.
func (s *Source) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.held = nil
	s.mu.Unlock()
	s.tel.close()
	s.calls.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	s.cleanup(ctx, s.opts.cleanup)
	return nil
}

// closeTimeout bounds the calls Close and the release of entries read after
// a Receive's context ended make.
const closeTimeout = 5 * time.Second

// cleanup deletes this consumer's name if it holds nothing, and those of
// others idle for at least idle (0: none) that hold nothing. A failure is
// logged: nothing depends on it.
func (s *Source) cleanup(ctx context.Context, idle time.Duration) {
	s.count(cmdCleanup)
	sent := time.Now()
	gone, err := cleanupScript.Run(ctx, s.client, []string{s.stream}, s.group, s.consumer, idle.Milliseconds()).StringSlice()
	s.conn.observe(sent, err)
	if err != nil {
		s.failed(cmdCleanup)
		if !isNoGroup(err) && !isNoSuchKey(err) {
			s.logger.Warn("redisstream: cleaning up idle consumer names failed", "stream", s.stream, "group", s.group, "error", err)
		}
		return
	}
	for _, name := range gone {
		if name != s.consumer {
			s.logger.Info("redisstream: deleted an idle consumer name that held no entries", "stream", s.stream, "group", s.group, "consumer", name)
		}
	}
}

func (s *Source) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// dueEntry is an entry this Source gave back with a delay, and when it
// falls due (by the Source's clock).
type dueEntry struct {
	id string
	at time.Time
}

// dueHeap orders given-back entries by due time.
type dueHeap []dueEntry

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h dueHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *dueHeap) Push(x any)        { *h = append(*h, x.(dueEntry)) }
func (h *dueHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// maxTracked bounds how many given-back entries the Source remembers to
// claim when they fall due; past it, the scans find them.
const maxTracked = 100_000

// track remembers to claim id at, if there is room.
func (s *Source) track(id string, at time.Time) {
	s.mu.Lock()
	if len(s.due) < maxTracked && !s.closed {
		heap.Push(&s.due, dueEntry{id: id, at: at})
	}
	s.mu.Unlock()
}
