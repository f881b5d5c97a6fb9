package crashbench

import (
	"testing"
	"time"
)

var brokers = []broker{sqsBroker, rabbitBroker, kafkaBroker}

// TestCrashLosesNothing kills custody's consumer twice with SIGKILL in the
// middle of a stream on each broker, and checks that every message had its
// effect: whatever a killed consumer had not acknowledged came back.
func TestCrashLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills consumer processes on every broker; skipped under -short")
	}
	for _, b := range brokers {
		t.Run(b.name, func(t *testing.T) {
			const kills = 2
			life := 100 * time.Millisecond
			if b.name == "kafka" {
				// Past the commit interval, so that a kill can follow a
				// commit: one that covered an unfinished record would lose
				// it.
				life = 2 * time.Second
			}
			tl := run(t, b, "custody", scenario{messages: 1000, kills: kills, life: life, backlog: 1000})
			t.Logf("%v", tl)
			if tl.lost() != 0 {
				t.Errorf("%d of %d messages lost", tl.lost(), len(tl.counts))
			}
			if tl.kills != kills {
				t.Errorf("%d kills made, want %d", tl.kills, kills)
			}
		})
	}
}

// BenchmarkCrash measures, for custody's consumer and a raw client loop on
// each broker: the messages lost and the effects repeated per SIGKILL, over
// -crash.kills kills, and the throughput of the same consumer without
// kills. See the package documentation.
func BenchmarkCrash(b *testing.B) {
	for _, br := range brokers {
		for _, reader := range []string{"custody", "raw"} {
			b.Run(br.name+"/"+reader, func(b *testing.B) {
				var (
					lost, repeats, kills int
					rate                 float64
				)
				for range b.N {
					plain := run(b, br, reader, scenario{messages: *flagMessages})
					crashed := run(b, br, reader, scenario{
						messages: *flagMessages,
						kills:    *flagKills,
						life:     *flagLife,
						backlog:  max(1000, int(plain.rate()/2)), // half a second's work
					})
					b.Logf("without kills: %v, %.0f msg/s; with kills: %v", plain, plain.rate(), crashed)
					lost += crashed.lost()
					repeats += crashed.repeats()
					kills += crashed.kills
					rate += plain.rate()
				}
				b.ReportMetric(0, "ns/op")
				b.ReportMetric(float64(lost), "lost")
				b.ReportMetric(float64(kills)/float64(b.N), "kills")
				if kills > 0 {
					b.ReportMetric(float64(repeats)/float64(kills), "repeats/kill")
				}
				b.ReportMetric(rate/float64(b.N), "msg/s")
			})
		}
	}
}
