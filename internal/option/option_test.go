package option

import (
	"errors"
	"testing"
)

type opt func(*[]string) error

func TestApplyRunsOptionsInOrderSkipsNilAndStopsAtTheFirstError(t *testing.T) {
	add := func(s string) opt { return func(l *[]string) error { *l = append(*l, s); return nil } }
	boom := errors.New("boom")
	var got []string
	err := Apply(&got, []opt{add("a"), nil, add("b"), func(*[]string) error { return boom }, add("c")})
	if !errors.Is(err, boom) {
		t.Fatalf("Apply = %v, want the failing option's error", err)
	}
	if len(got) != 2 || got[0] != "a" || got[1] != "b" {
		t.Fatalf("options applied: %v, want [a b]", got)
	}
}
