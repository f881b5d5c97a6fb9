// Package testparallel raises how many parallel tests a test binary runs,
// for packages whose tests spend their time waiting on a broker's timers
// (leases, quiet periods, long polls) rather than on the CPU: there the
// default, GOMAXPROCS, leaves a two-core machine mostly idle.
package testparallel

import (
	"flag"
	"strconv"
)

// AtLeast sets -test.parallel to n, unless the command line set it or it
// is already higher. Call it from TestMain, before m.Run.
func AtLeast(n int) {
	if !flag.Parsed() {
		flag.Parse()
	}
	set := false
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "test.parallel" {
			set = true
		}
	})
	f := flag.Lookup("test.parallel")
	if set || f == nil {
		return
	}
	if cur, err := strconv.Atoi(f.Value.String()); err == nil && cur >= n {
		return
	}
	_ = f.Value.Set(strconv.Itoa(n))
}
