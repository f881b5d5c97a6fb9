// Package testbroker holds helpers for tests that need a real broker or store.
package testbroker

import (
	"net"
	"os"
	"testing"
	"time"
)

// RequireEnv is the environment variable that turns a missing broker from a
// skipped test into a failed one. CI sets it.
const RequireEnv = "CUSTODY_REQUIRE_BROKERS"

// Required reports whether missing brokers must fail the run.
func Required() bool { return os.Getenv(RequireEnv) == "1" }

// Unavailable skips the test (or fails it when brokers are required) because
// what names is not reachable, for the reason given.
func Unavailable(t testing.TB, what string, reason error) {
	t.Helper()
	if Required() {
		t.Fatalf("%s is required (%s=1) but unavailable: %v", what, RequireEnv, reason)
	}
	t.Skipf("%s unavailable, skipping (set %s=1 to fail instead): %v", what, RequireEnv, reason)
}

// Dial checks that something listens at addr (host:port) and calls
// Unavailable when nothing does.
func Dial(t testing.TB, what, addr string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		Unavailable(t, what+" at "+addr, err)
		return
	}
	c.Close()
}

// Addr returns the value of the environment variable env, or def.
func Addr(env, def string) string {
	if v := os.Getenv(env); v != "" {
		return v
	}
	return def
}
