// Command replay lists the dead letters of a dead-letter queue, grouped by
// error, consumer and hour (a dry run), and moves a selection of them back to
// the queues they came from at a bounded rate: copy, wait for the broker's
// confirmation, then delete, so that no message is lost in the move and a
// run cut short can be run again.
//
// With no setup, on the embedded memory broker: a demo publishes orders,
// dead-letters a few (a bug and an outage), lists them, replays them once
// the "fix" is in, and shows each handled once:
//
//	go run ./examples/replay -broker memory
//	go run ./examples/replay -broker memory -error unavailable   # the outage's only
//
// On SQS, against any endpoint the AWS SDK's default configuration finds
// (the credential chain and region, or AWS_ENDPOINT_URL_SQS for an
// emulator):
//
//	go run ./examples/replay -broker sqs -dlq https://sqs.eu-west-1.amazonaws.com/123456789012/orders-dlq -list
//	go run ./examples/replay -broker sqs -dlq URL -replay -error "payment service" -since 2h -max 500 -rate 20
//
// Selection (for -replay, and shown by -list): -error (a substring of the
// error text), -consumer (the consumer's name, exactly), -since (a duration
// back from now, or an RFC 3339 time: the last failure at or after it).
// -max bounds the messages replayed, -rate the messages a second (default
// 10), and -keep-diagnostics keeps the diagnostics on the replayed copies,
// packed into one header (custody-replay-diagnostics); by default they are
// stripped. Every copy carries custody-replay-of, the dead letter's id.
//
// On RabbitMQ, -dlq names the dead-letter queue and -url the broker:
//
//	go run ./examples/replay -broker rabbitmq -url amqp://guest:guest@127.0.0.1:5672/ -dlq orders.dlq -list
//	go run ./examples/replay -broker rabbitmq -dlq orders.dlq -replay -error timeout -rate 50
//
// Copies go to each dead letter's original queue through the default
// exchange; -through-exchange publishes them through the exchange and
// routing key the message was first published with instead, which reaches
// every queue bound to that route.
//
// On Kafka, -dlt names the dead-letter topic, -brokers the cluster and
// -group the replay group, whose offsets on the topic are the replay's
// progress (Kafka deletes no record):
//
//	go run ./examples/replay -broker kafka -brokers kafka-1:9092 -dlt orders.dlq -group orders.dlq-replay -list
//	go run ./examples/replay -broker kafka -brokers kafka-1:9092 -dlt orders.dlq -group orders.dlq-replay -replay -error timeout
//
// Copies go to each dead letter's original topic with its key, so they land
// in the key's partition. -list reads beyond the group's offsets and
// commits nothing; -replay commits each batch of copies with the group's
// offsets in one Kafka transaction, so a run cut short and run again copies
// every dead letter once, for consumers that read committed records only.
// The group passes the dead letters the selection leaves out: to replay
// them later, use another -group (which starts at the topic's start, and
// sees what this one replayed as well).
//
// On SQS, -list receives the dead letters for a moment and gives them back
// (SQS cannot show a message otherwise; each listing adds one to their
// receive counts), and a replay cut short between a copy and its deletion
// sends that one message back twice when run again into a standard queue
// (with the same custody-replay-of), and once into a FIFO queue: see
// docs/sqs.md. On RabbitMQ, -list takes the dead letters without acking
// them and gives them back (each comes back flagged redelivered; on a
// quorum queue its delivery count grows and the order can change), and a
// replay cut short between a copy's confirm and the dead letter's ack sends
// that one message back twice when run again, with the same message-id and
// custody-replay-of: see docs/rabbitmq.md.
//
// Each broker is a value of -broker with a function that opens its
// dead-letter destination (see brokers below); -dlq names the destination
// in that broker's terms (-dlt and -group on Kafka).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"os"
	"os/signal"
	"slices"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/custody-go/custody/adapters"
)

// replayer is what every adapter's dead-letter replay offers.
type replayer interface {
	List(ctx context.Context, max int) ([]adapters.DeadLetterRecord, error)
	Replay(ctx context.Context, o adapters.ReplayOptions) (adapters.ReplayResult, error)
}

// destination is an opened dead-letter destination.
type destination struct {
	replayer
	// name is what the output calls it.
	name string
	// after, when set, runs once the list and the replay are done (the
	// memory demo's consumer, fixed, handles what came back).
	after func(ctx context.Context, out io.Writer) error
	// close releases what opening took; may be nil.
	close func()
	// skipped says what the replay's Skipped count holds; empty for the
	// usual sentence.
	skipped string
}

// brokers opens a -broker's dead-letter destination.
var brokers = map[string]func(ctx context.Context, cfg config, out io.Writer) (*destination, error){
	"kafka":    openKafka,
	"memory":   openMemory,
	"rabbitmq": openRabbitMQ,
	"sqs":      openSQS,
}

type config struct {
	broker string
	dlq    string
	list   bool
	replay bool
	// listMax bounds the dead letters -list reads.
	listMax int

	errorText string
	consumer  string
	since     time.Time // zero: no bound
	max       int
	rate      float64
	keepDiag  bool

	// SQS
	wait time.Duration
	hold time.Duration

	// RabbitMQ
	url             string
	throughExchange bool

	// Kafka
	brokers string
	dlt     string
	group   string
}

func main() {
	cfg, err := parseFlags(os.Args[1:], time.Now())
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

func brokerNames() string {
	names := make([]string, 0, len(brokers))
	for n := range brokers {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// parseFlags reads the command line; now anchors a -since given as a
// duration.
func parseFlags(args []string, now time.Time) (config, error) {
	var cfg config
	var since string
	fs := flag.NewFlagSet("replay", flag.ContinueOnError)
	fs.StringVar(&cfg.broker, "broker", "memory", "the broker: "+brokerNames())
	fs.StringVar(&cfg.dlq, "dlq", "", "the dead-letter destination: an SQS queue URL, a RabbitMQ queue name (the memory demo makes its own; Kafka: -dlt)")
	fs.BoolVar(&cfg.list, "list", false, "list the dead letters, grouped by error, consumer and hour (a dry run)")
	fs.BoolVar(&cfg.replay, "replay", false, "replay the selected dead letters to their original queues")
	fs.IntVar(&cfg.listMax, "list-max", 1000, "the most dead letters -list reads")
	fs.StringVar(&cfg.errorText, "error", "", "select dead letters whose error text contains this")
	fs.StringVar(&cfg.consumer, "consumer", "", "select dead letters of this consumer")
	fs.StringVar(&since, "since", "", "select dead letters whose last failure is at or after this: a duration back from now (2h) or an RFC 3339 time")
	fs.IntVar(&cfg.max, "max", 0, "replay at most this many (0: no bound)")
	fs.Float64Var(&cfg.rate, "rate", 10, "replay at most this many a second")
	fs.BoolVar(&cfg.keepDiag, "keep-diagnostics", false, "keep the diagnostics on the replayed copies, in custody-replay-diagnostics")
	fs.DurationVar(&cfg.wait, "wait", time.Second, "SQS: the long-poll wait of each receive (whole seconds, up to 20s)")
	fs.DurationVar(&cfg.hold, "hold", time.Minute, "SQS: how long dead letters being looked at stay out of other receivers' sight")
	fs.StringVar(&cfg.url, "url", "amqp://guest:guest@localhost:5672/", "RabbitMQ: the broker's AMQP URL")
	fs.BoolVar(&cfg.throughExchange, "through-exchange", false, "RabbitMQ: replay through the original exchange and routing key, to every queue bound to that route, instead of to the original queue alone")
	fs.StringVar(&cfg.brokers, "brokers", "localhost:9092", "Kafka: the seed brokers, comma-separated")
	fs.StringVar(&cfg.dlt, "dlt", "", "Kafka: the dead-letter topic")
	fs.StringVar(&cfg.group, "group", "", "Kafka: the replay group, whose offsets on the dead-letter topic record what was looked at (a new group starts at the topic's start)")
	if err := fs.Parse(args); err != nil {
		return cfg, err
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected arguments %q; every setting is a flag (-h lists them)", fs.Args())
	}
	if _, ok := brokers[cfg.broker]; !ok {
		return cfg, fmt.Errorf("-broker %q: unknown; one of %s", cfg.broker, brokerNames())
	}
	var misplaced error
	fs.Visit(func(f *flag.Flag) {
		switch {
		case misplaced != nil:
		case (f.Name == "url" || f.Name == "through-exchange") && cfg.broker != "rabbitmq":
			misplaced = fmt.Errorf("-%s applies to -broker rabbitmq only", f.Name)
		case (f.Name == "brokers" || f.Name == "dlt" || f.Name == "group") && cfg.broker != "kafka":
			misplaced = fmt.Errorf("-%s applies to -broker kafka only", f.Name)
		case f.Name == "dlq" && cfg.broker == "kafka":
			misplaced = errors.New("-dlq: -broker kafka names its dead-letter topic with -dlt, and its replay group with -group")
		}
	})
	if misplaced != nil {
		return cfg, misplaced
	}
	if since != "" {
		if d, err := time.ParseDuration(since); err == nil && d >= 0 {
			cfg.since = now.Add(-d)
		} else if t, err := time.Parse(time.RFC3339, since); err == nil {
			cfg.since = t
		} else {
			return cfg, fmt.Errorf("-since %q: give a duration back from now (90m, 2h) or an RFC 3339 time (2026-12-06T08:00:00Z)", since)
		}
	}
	if !cfg.list && !cfg.replay {
		if cfg.broker != "memory" {
			return cfg, errors.New("say what to do: -list (a dry run: the dead letters, grouped) or -replay (move the selected ones back), or both")
		}
		cfg.list, cfg.replay = true, true // the whole demo
	}
	switch {
	case cfg.listMax < 1:
		return cfg, fmt.Errorf("-list-max %d: must be at least 1", cfg.listMax)
	case cfg.max < 0:
		return cfg, fmt.Errorf("-max %d: must not be negative (0: no bound)", cfg.max)
	case !(cfg.rate > 0):
		return cfg, fmt.Errorf("-rate %v: must be positive", cfg.rate)
	}
	return cfg, nil
}

// selector is the ReplayOptions.Select of the selection flags; nil when
// they select everything.
func (cfg config) selector() func(adapters.DeadLetterRecord) bool {
	if cfg.errorText == "" && cfg.consumer == "" && cfg.since.IsZero() {
		return nil
	}
	return func(r adapters.DeadLetterRecord) bool {
		return strings.Contains(r.Error, cfg.errorText) &&
			(cfg.consumer == "" || r.Consumer == cfg.consumer) &&
			(cfg.since.IsZero() || !r.LastFailure.Before(cfg.since))
	}
}

func run(ctx context.Context, cfg config, out io.Writer) error {
	dst, err := brokers[cfg.broker](ctx, cfg, out)
	if err != nil {
		return err
	}
	if dst.close != nil {
		defer dst.close()
	}
	if cfg.list {
		if err := list(ctx, dst, cfg, out); err != nil {
			return err
		}
	}
	if cfg.replay {
		res, err := dst.Replay(ctx, adapters.ReplayOptions{
			Select:          cfg.selector(),
			Rate:            cfg.rate,
			Max:             cfg.max,
			KeepDiagnostics: cfg.keepDiag,
		})
		skipped := dst.skipped
		if skipped == "" {
			skipped = "left out by the selection, or copied before and now deleted"
		}
		fmt.Fprintf(out, "replayed %d, skipped %d (%s)\n", res.Replayed, res.Skipped, skipped)
		if err != nil {
			return fmt.Errorf("the replay stopped: %w", err)
		}
	}
	if dst.after != nil {
		return dst.after(ctx, out)
	}
	return nil
}

// list prints the dead letters, grouped, with how many the selection
// flags pick.
func list(ctx context.Context, dst *destination, cfg config, out io.Writer) error {
	recs, err := dst.List(ctx, cfg.listMax)
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "%d dead letters in %s", len(recs), dst.name)
	if len(recs) == cfg.listMax {
		fmt.Fprintf(out, " (the first %d: -list-max)", cfg.listMax)
	}
	fmt.Fprintln(out, ", by error, consumer and hour of the last failure:")
	selected := map[string]bool{}
	if sel := cfg.selector(); sel != nil {
		for _, r := range recs {
			selected[r.ID] = sel(r)
		}
	}
	tw := tabwriter.NewWriter(out, 2, 8, 2, ' ', 0)
	fmt.Fprintln(tw, "COUNT\tSELECTED\tHOUR (UTC)\tCONSUMER\tERROR")
	for _, g := range adapters.GroupDeadLetters(recs) {
		n := g.Count
		if len(selected) > 0 {
			n = 0
			for _, id := range g.IDs {
				if selected[id] {
					n++
				}
			}
		}
		hour := "-"
		if !g.Hour.IsZero() && g.Hour.Year() > 1 {
			hour = g.Hour.Format("2006-01-02 15:00")
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%s\t%s\n", g.Count, n, hour, orDash(g.Consumer), orDash(oneLine(g.Error, 100)))
	}
	return tw.Flush()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// oneLine shortens an error text to one line of at most n characters.
func oneLine(s string, n int) string {
	s = strings.Join(strings.Fields(s), " ")
	if r := []rune(s); len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return s
}

// sortedKeys returns m's keys in order.
func sortedKeys[V any](m map[int]V) []int {
	keys := make([]int, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
