package kafka

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
)

// Deliveries share string buffers: every delivery keeps its own ID, key,
// ordering key and headers however many are built after it, short or long.
func TestDeliveryStringsStayIntact(t *testing.T) {
	for _, mode := range []OrderingScope{ByPartition, ByKey, Unordered} {
		t.Run(mode.String(), func(t *testing.T) {
			s := &Source{cfg: defaultConfig()}
			s.cfg.ordering = mode
			p := newPartition("orders", 3, 1)
			long := strings.Repeat("k", maxSharedStr+1)
			key := func(i int) string {
				switch i % 4 {
				case 0:
					return ""
				case 1:
					return long + fmt.Sprint(i)
				}
				return fmt.Sprintf("key-%d", i)
			}
			var hs []*held
			for i := 0; i < 3*heldSlab+strChunk/8; i++ {
				r := &kgo.Record{Topic: "orders", Partition: 3, Offset: int64(1000 + i), Key: []byte(key(i)), Value: []byte("v")}
				if i%3 == 0 {
					r.Headers = []kgo.RecordHeader{{Key: "a", Value: []byte(fmt.Sprint(i))}, {Key: "b", Value: []byte(long)}, {Key: "c"}}
				}
				hs = append(hs, s.newHeld(p, r, time.Now()))
			}
			for i, h := range hs {
				d := &h.d
				if want := fmt.Sprintf("orders/3/%d", 1000+i); d.ID != want {
					t.Fatalf("ID = %q, want %q", d.ID, want)
				}
				if d.Key != key(i) {
					t.Fatalf("Key = %q, want %q", d.Key, key(i))
				}
				want := ""
				switch {
				case mode == ByPartition, mode == ByKey && key(i) == "":
					want = "orders/3"
				case mode == ByKey:
					want = "orders/3/" + key(i)
				}
				if d.OrderingKey != want {
					t.Fatalf("OrderingKey = %q, want %q", d.OrderingKey, want)
				}
				if d.Native.(*kgo.Record).Offset != d.Offset || d.Handle != h || h.p != p {
					t.Fatal("Native, Handle or partition not set")
				}
				if i%3 != 0 {
					if d.Headers != nil {
						t.Fatalf("Headers = %v, want nil", d.Headers)
					}
					continue
				}
				if len(d.Headers) != 3 || d.Headers["a"] != fmt.Sprint(i) || d.Headers["b"] != long || d.Headers["c"] != "" {
					t.Fatalf("Headers = %v", d.Headers)
				}
			}
		})
	}
}
