package main

import "testing"

// TestCrashLosesNothingAndDedupAbsorbsRepeats runs both halves of the
// demonstration and holds them to what the program prints.
func TestCrashLosesNothingAndDedupAbsorbsRepeats(t *testing.T) {
	plain, err := crashOnce(false)
	if err != nil {
		t.Fatal(err)
	}
	if plain.lost != 0 {
		t.Fatalf("plain handler: %d messages lost", plain.lost)
	}
	if plain.repeated != plain.unacked {
		t.Errorf("plain handler: %d repeated effects, but %d effects were left unacked by the crash", plain.repeated, plain.unacked)
	}
	dedup, err := crashOnce(true)
	if err != nil {
		t.Fatal(err)
	}
	if dedup.lost != 0 || dedup.repeated != 0 {
		t.Fatalf("with idempotency: %d lost, %d repeated; want none", dedup.lost, dedup.repeated)
	}
}
