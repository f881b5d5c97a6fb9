package adapters

import (
	"sync"
	"sync/atomic"
	"time"
)

// Signal carries what an adapter learns about a delivery outside the
// runtime's calls: that the delivery was lost (its channel closed, its
// partition was revoked, another receive took its message) or that the
// adapter wants it back (a partition being revoked). The runtime watches it:
// a loss cancels the handler's context with the cause, a recall gives the
// delivery back if its handler has not started.
//
// One Signal belongs to one delivery. The zero value is ready to use, so an
// adapter may embed it in its own per-delivery state and point
// [Delivery.Signal] at it. An adapter whose deliveries are lost only through
// the results of Ack, Nack and Extend (an entry failing with [ErrLeaseLost])
// leaves Delivery.Signal nil; the runtime then gives the delivery a Signal
// of its own. All methods are safe to call from any goroutine, and the
// methods that read a Signal answer for a nil one as for a delivery that is
// neither lost nor recalled.
type Signal struct {
	mu sync.Mutex
	// flags holds flagLost and flagRecalled: set under mu, read without it,
	// since the runtime asks per job, nearly always of a delivery that is
	// neither.
	flags    atomic.Uint32
	onLost   func(error)
	onRecall func()
	// rare holds what most deliveries never need, made on first need: a
	// Signal is allocated with every delivery, so it keeps to 40 bytes.
	// Guarded by mu.
	rare *signalRare
}

// signalRare is the part of a Signal made by a loss, or by a request for a
// channel.
type signalRare struct {
	lost   error         // the cause given to Lose; set with flagLost
	lostAt time.Time     // when Lose was first called
	lostCh chan struct{} // handed out by Lost, closed by Lose
	recall chan struct{} // handed out by RecallSignal, closed by Recall
}

const (
	flagLost uint32 = 1 << iota
	flagRecalled
)

// Lose marks the delivery as no longer ackable by this consumer and says
// why; a nil cause means [ErrLeaseLost]. Only the first call has an effect.
func (s *Signal) Lose(cause error) {
	s.mu.Lock()
	if s.flags.Load()&flagLost != 0 {
		s.mu.Unlock()
		return
	}
	if cause == nil {
		cause = ErrLeaseLost
	}
	r := s.rareLocked()
	r.lost, r.lostAt = cause, time.Now()
	s.flags.Or(flagLost)
	fn := s.onLost
	s.onLost = nil
	if r.lostCh != nil {
		close(r.lostCh)
	}
	s.mu.Unlock()
	if fn != nil {
		fn(cause)
	}
}

// Recall asks the runtime to give the delivery back if its handler has not
// started: the adapter wants the message back soon but can still take an
// ack (a Kafka partition being revoked, whose revoke waits for the records
// it handed out). A running handler is not disturbed and its ack still
// counts. Recall is no loss; call Lose for that. Only the first call has an
// effect.
//
// The runtime keeps a lane's order only if, of the deliveries of one lane
// (one ordered stream, such as a partition), the adapter recalls every one
// handed out after a recalled one too, the later ones first. A Source that
// recalls deliveries also implements [Recaller].
func (s *Signal) Recall() {
	if s.flags.Load()&flagRecalled != 0 {
		return
	}
	s.mu.Lock()
	var fn func()
	if s.flags.Load()&flagRecalled == 0 {
		s.flags.Or(flagRecalled)
		if s.rare != nil && s.rare.recall != nil {
			close(s.rare.recall)
		}
		fn, s.onRecall = s.onRecall, nil
	}
	s.mu.Unlock()
	if fn != nil {
		fn()
	}
}

// LostCause returns the cause given to Lose, or nil.
func (s *Signal) LostCause() error {
	if s == nil || s.flags.Load()&flagLost == 0 {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.rare.lost
}

// LostAt returns when Lose was first called, or the zero time.
func (s *Signal) LostAt() time.Time {
	if s == nil {
		return time.Time{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.rare == nil {
		return time.Time{}
	}
	return s.rare.lostAt
}

// Lost returns a channel closed once the delivery is lost.
func (s *Signal) Lost() <-chan struct{} {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return made(&s.rareLocked().lostCh, s.flags.Load()&flagLost != 0)
}

// OnLost registers fn to run once, on the goroutine that calls Lose, when
// the delivery is lost; at once if it is already. It replaces an earlier
// registration; OnLost(nil) removes it. The runtime cancels a handler's
// context this way, without a goroutine per delivery.
func (s *Signal) OnLost(fn func(error)) {
	s.mu.Lock()
	if s.flags.Load()&flagLost != 0 {
		cause := s.rare.lost
		s.mu.Unlock()
		if fn != nil {
			fn(cause)
		}
		return
	}
	s.onLost = fn
	s.mu.Unlock()
}

// OnRecall registers fn to run once, on the goroutine that calls Recall,
// when the delivery is recalled; at once if it is already. It replaces an
// earlier registration; OnRecall(nil) removes it.
func (s *Signal) OnRecall(fn func()) {
	s.mu.Lock()
	if s.flags.Load()&flagRecalled != 0 {
		s.mu.Unlock()
		if fn != nil {
			fn()
		}
		return
	}
	s.onRecall = fn
	s.mu.Unlock()
}

// Recalled reports whether Recall was called; one atomic load.
func (s *Signal) Recalled() bool { return s != nil && s.flags.Load()&flagRecalled != 0 }

// RecallSignal returns a channel closed once Recall is called.
func (s *Signal) RecallSignal() <-chan struct{} {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return made(&s.rareLocked().recall, s.Recalled())
}

func (s *Signal) rareLocked() *signalRare {
	if s.rare == nil {
		s.rare = new(signalRare)
	}
	return s.rare
}

// made returns *ch, made on the first call and closed at once if what it
// signals happened already.
func made(ch *chan struct{}, happened bool) chan struct{} {
	if *ch == nil {
		*ch = make(chan struct{})
		if happened {
			close(*ch)
		}
	}
	return *ch
}
