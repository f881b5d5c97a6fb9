package consumer

import (
	"fmt"
	"log/slog"
	"sync"
	"time"
)

// KillSwitch stops intake when too many attempts fail, so that a
// dependency's outage turns into a pause rather than into retries
// hammering it and messages running out of attempts. See WithKillSwitch.
type KillSwitch struct {
	// Window is how far back attempts are counted. Default 30s.
	Window time.Duration
	// MinAttempts is how many attempts the window must hold before the
	// switch may trip. Default 20.
	MinAttempts int
	// Ratio is the share of failed attempts in the window at which the
	// switch trips. Default 0.5.
	Ratio float64
	// Cooldown is how long the switch stays open before it lets probes
	// through. Default 30s.
	Cooldown time.Duration
	// Probes is how many attempts run while the switch is half-open; all
	// must succeed for it to close, and the first that fails opens it
	// again. Default 3.
	Probes int
	// Counts reports whether a failed attempt's error counts as a failure.
	// Default: every error but a Permanent one (the message's own fault)
	// and a deferral; Unavailable errors count.
	Counts func(err error) bool
}

// WithKillSwitch trips when, over k.Window, at least k.MinAttempts handler
// attempts were made and a share k.Ratio of them failed (as k.Counts
// decides). Tripped (open), the consumer stops receiving, as Pause does,
// and the deliveries it holds that are not running wait, their leases kept
// alive, without running and without using up an attempt: nothing is
// dead-lettered for the outage. After k.Cooldown the switch half-opens:
// intake resumes and up to k.Probes attempts run; if all succeed the
// switch closes and everything runs again, if one fails it opens again for
// another cooldown. Its state shows in Status and the readiness probe, its
// trips in custody.killswitch.trips, and each change is logged. Default:
// no kill switch.
func WithKillSwitch(k KillSwitch) Option {
	return optionFunc(func(c *config) error {
		if k.Window == 0 {
			k.Window = 30 * time.Second
		}
		if k.MinAttempts == 0 {
			k.MinAttempts = 20
		}
		if k.Ratio == 0 {
			k.Ratio = 0.5
		}
		if k.Cooldown == 0 {
			k.Cooldown = 30 * time.Second
		}
		if k.Probes == 0 {
			k.Probes = 3
		}
		if k.Counts == nil {
			k.Counts = countsAgainstKillSwitch
		}
		switch {
		case k.Window < time.Second:
			return fmt.Errorf("consumer: WithKillSwitch: Window %v must be at least a second", k.Window)
		case k.MinAttempts < 1:
			return fmt.Errorf("consumer: WithKillSwitch: MinAttempts %d must be positive", k.MinAttempts)
		case !(k.Ratio > 0 && k.Ratio <= 1):
			return fmt.Errorf("consumer: WithKillSwitch: Ratio %v must be in (0, 1]", k.Ratio)
		case k.Cooldown < 0:
			return fmt.Errorf("consumer: WithKillSwitch: Cooldown %v must not be negative", k.Cooldown)
		case k.Probes < 1:
			return fmt.Errorf("consumer: WithKillSwitch: Probes %d must be positive", k.Probes)
		}
		c.killSwitch = &k
		return nil
	})
}

func countsAgainstKillSwitch(err error) bool { return !IsPermanent(err) && !IsDeferred(err) }

type switchState int

const (
	switchClosed switchState = iota
	switchOpen
	switchHalfOpen
)

// killSwitch is a run's kill switch.
type killSwitch struct {
	cfg KillSwitch
	r   *run

	mu        sync.Mutex
	state     switchState
	buckets   []switchBucket // one a second, over the window
	probes    int            // attempts still let through while half-open
	succeeded int            // probes that succeeded
	timer     *time.Timer
	timerWG   sync.WaitGroup // an armed or running cooldown timer
}

type switchBucket struct {
	sec        int64
	ok, failed int
}

func newKillSwitch(cfg KillSwitch, r *run) *killSwitch {
	return &killSwitch{cfg: cfg, r: r, buckets: make([]switchBucket, int(cfg.Window/time.Second))}
}

var switchStateNames = [...]string{switchClosed: "closed", switchOpen: "open", switchHalfOpen: "half-open"}

func (k *killSwitch) stateName() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return switchStateNames[k.state]
}

// admit reports whether an attempt may run now: always while closed, a
// probe while half-open.
func (k *killSwitch) admit() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	switch k.state {
	case switchClosed:
		return true
	case switchHalfOpen:
		if k.probes > 0 {
			k.probes--
			return true
		}
	}
	return false
}

// record counts an attempt's outcome, and trips, reopens or closes the
// switch.
func (k *killSwitch) record(err error) {
	failed := err != nil && k.cfg.Counts(err)
	if err != nil && !failed && !IsPermanent(err) {
		return // a deferral, or a failure the switch does not count: no evidence either way
	}
	now := time.Now()
	k.mu.Lock()
	switch k.state {
	case switchHalfOpen:
		if failed {
			k.openLocked(now, "a probe failed")
			k.mu.Unlock()
			return
		}
		k.succeeded++
		if k.succeeded >= k.cfg.Probes {
			k.state = switchClosed
			k.clearLocked()
			k.mu.Unlock()
			k.r.logs.log(logKillSwitchClosed, slog.Int("probes", k.cfg.Probes))
			k.r.c.intake.trip(false)
			k.r.c.reportPaused(false)
			k.r.unparkAll(func(j *job) bool { return j.heldBySwitch })
			return
		}
	case switchClosed:
		sec := now.Unix()
		b := &k.buckets[sec%int64(len(k.buckets))]
		if b.sec != sec {
			b.sec, b.ok, b.failed = sec, 0, 0
		}
		if !failed {
			b.ok++
			break
		}
		b.failed++
		var ok, bad int
		for _, b := range k.buckets {
			if sec-b.sec < int64(len(k.buckets)) {
				ok, bad = ok+b.ok, bad+b.failed
			}
		}
		if ok+bad >= k.cfg.MinAttempts && float64(bad) >= k.cfg.Ratio*float64(ok+bad) {
			k.openLocked(now, fmt.Sprintf("%d of %d attempts failed over %v", bad, ok+bad, k.cfg.Window))
		}
	}
	k.mu.Unlock()
}

// openLocked trips the switch; called with mu held.
func (k *killSwitch) openLocked(now time.Time, why string) {
	k.state = switchOpen
	k.succeeded, k.probes = 0, 0
	k.clearLocked()
	k.r.tel.killSwitchTrips.Add(k.r.settleCtx, 1, k.r.tel.source...)
	k.r.logs.log(logKillSwitchOpen, slog.String("reason", why), slog.Duration("cooldown", k.cfg.Cooldown))
	k.r.c.intake.trip(true)
	k.r.c.state.CompareAndSwap(int32(StateRunning), int32(StatePaused))
	k.r.c.syncSourcePause()
	if k.timer != nil && k.timer.Stop() {
		k.timerWG.Done()
	}
	k.timerWG.Add(1)
	k.timer = time.AfterFunc(k.cfg.Cooldown, func() { defer k.timerWG.Done(); k.halfOpen() })
}

// halfOpen lets probes through after the cooldown.
func (k *killSwitch) halfOpen() {
	k.mu.Lock()
	if k.state != switchOpen {
		k.mu.Unlock()
		return
	}
	k.state, k.probes, k.succeeded = switchHalfOpen, k.cfg.Probes, 0
	k.mu.Unlock()
	k.r.logs.log(logKillSwitchHalfOpen, slog.Int("probes", k.cfg.Probes))
	// Intake resumes so that there is something to probe with; what is
	// not a probe waits as while the switch was open.
	k.r.c.intake.trip(false)
	k.r.c.syncSourcePause()
	k.r.unparkAll(func(j *job) bool { return j.heldBySwitch })
}

func (k *killSwitch) clearLocked() {
	for i := range k.buckets {
		k.buckets[i].sec = 0
	}
}

// stop ends the cooldown timer; once it returns, none runs.
func (k *killSwitch) stop() {
	k.mu.Lock()
	if k.timer != nil && k.timer.Stop() {
		k.timerWG.Done()
	}
	k.timer = nil
	k.mu.Unlock()
	k.timerWG.Wait()
}
