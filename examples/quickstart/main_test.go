package main

import "testing"

// TestQuickstart runs the program as `go run ./examples/quickstart` does; it
// fails when the program reports an outcome other than the one it promises.
func TestQuickstart(t *testing.T) {
	if err := run(); err != nil {
		t.Fatal(err)
	}
}
