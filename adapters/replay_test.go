package adapters

import (
	"errors"
	"testing"
	"time"
)

func TestReadDeadLetterReadsWhatDiagnosticsWrote(t *testing.T) {
	first := time.Date(2026, 12, 6, 7, 0, 0, 0, time.UTC)
	d := &Delivery{ID: "orders/3/42", Queue: "orders", Partition: 3, Offset: 42, Key: "k1", Headers: map[string]string{"traceparent": "x"}}
	h := Diagnostics(d, Failure{Err: errors.New("boom"), Permanent: true, Attempts: 4, FirstFailure: first, LastFailure: first.Add(time.Minute), Consumer: "payments"})
	for k, v := range d.Headers {
		h[k] = v
	}
	var rec DeadLetterRecord
	if !ReadDeadLetter(&rec, h) {
		t.Fatal("no diagnostics found")
	}
	if rec.Error != "boom" || !rec.Permanent || rec.Attempts != 4 || rec.Consumer != "payments" ||
		rec.OriginalQueue != "orders" || rec.OriginalID != "orders/3/42" || rec.Partition != 3 || rec.Offset != 42 ||
		rec.Key != "k1" || !rec.FirstFailure.Equal(first) || !rec.LastFailure.Equal(first.Add(time.Minute)) {
		t.Fatalf("read %+v", rec)
	}
	if len(rec.Headers) != 1 || rec.Headers["traceparent"] != "x" {
		t.Fatalf("original headers %v, want the traceparent alone", rec.Headers)
	}
	if ReadDeadLetter(&DeadLetterRecord{}, map[string]string{"a": "b"}) {
		t.Fatal("headers without diagnostics read as a dead letter")
	}
}

func TestGroupDeadLetters(t *testing.T) {
	at := time.Date(2026, 12, 6, 7, 10, 0, 0, time.UTC)
	recs := []DeadLetterRecord{
		{ID: "1", Error: "a", Consumer: "c", LastFailure: at},
		{ID: "2", Error: "b", Consumer: "c", LastFailure: at},
		{ID: "3", Error: "a", Consumer: "c", LastFailure: at.Add(20 * time.Minute)},
		{ID: "4", Error: "a", Consumer: "c", LastFailure: at.Add(time.Hour)},
	}
	g := GroupDeadLetters(recs)
	if len(g) != 3 || g[0].Error != "a" || g[0].Count != 2 || g[0].IDs[0] != "1" || g[0].IDs[1] != "3" {
		t.Fatalf("groups %+v", g)
	}
}
