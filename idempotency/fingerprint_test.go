package idempotency_test

import (
	"testing"

	"github.com/custody-go/custody/idempotency"
)

// FingerprintBody's output is stored with each key, so it must not change
// between versions: a record written before an upgrade would no longer match
// its own payload, and every redelivery of it would be dead-lettered as a
// fingerprint mismatch. The values are SHA-256 in unpadded URL-safe base64.
func TestFingerprintBodyIsStableAcrossVersions(t *testing.T) {
	for body, want := range map[string]string{
		"pay 10": "Y0LBu0P5bcaKTsb3dlju8dkVZCZ3icqXNQ7V5qqd33w",
		"a":      "ypeBEsobvcr6wjGzmiPcTaeG7_gUfE5yuYB3ha_uSLs",
		"x":      "LXEWQrcmsEQBYnyp-6wy9chTD7GQPMTbAiWHF5IaSIE",
	} {
		if got := idempotency.FingerprintBody(msg("m", body)); got != want {
			t.Errorf("FingerprintBody(%q) = %q, want %q as earlier versions stored it", body, got, want)
		}
	}
}
