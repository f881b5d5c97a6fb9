package redisstream

import "sync/atomic"

// Stats are a Source's counters since it was created: the commands it sent
// (a script counts as one: one round trip), and what became of entries.
// Divide Commands by Received for the commands per message. They serve
// tests and benchmarks; in production, read the OpenTelemetry metrics,
// which count the same commands.
type Stats struct {
	// Reads, Reclaims, Acks, Deletes, Renewals, Nacks, Cleanups and Infos
	// count XREADGROUP, reclaim-script, XACK, XDEL, renewal-script,
	// give-back-script, clean-up-script and backlog (XINFO GROUPS, or the
	// script of Backlog) commands; Failures those of them that failed.
	Reads, Reclaims, Acks, Deletes, Renewals, Nacks, Cleanups, Infos int64
	Failures                                                         int64
	// Received counts entries handed out, Reclaimed those of them claimed
	// once idle for the lease (a dead consumer's, or retries that fell due).
	Received, Reclaimed int64
	// Acked counts entries XACK removed from the pending list;
	// AckedNotPending those it found no longer pending (acked before, or by
	// the consumer that reclaimed them).
	Acked, AckedNotPending int64
	// Renewed counts lease renewals that took; LeaseLost entries found lost:
	// by renewals and give-backs (claimed by another consumer, or no longer
	// pending), and held entries of a group found missing.
	Renewed, LeaseLost int64
	// Nacked counts entries given back; Parked the times an entry was set
	// aside for a delay longer than the lease (at the give-back, and at each
	// reclaim that found it not due yet).
	Nacked, Parked int64
	// Deleted counts pending entries a reclaim found deleted from the stream
	// (dropped from the pending list, never handed out); DeletedWhileHeld
	// held entries a renewal found deleted (their handler ran on).
	Deleted, DeletedWhileHeld int64
	// Released counts entries read for a Receive whose context ended (or
	// whose Source closed) meanwhile, given back at once.
	Released int64
	// GroupMissing counts the times the group was found missing.
	GroupMissing int64
}

// Commands returns the number of commands sent.
func (st Stats) Commands() int64 {
	return st.Reads + st.Reclaims + st.Acks + st.Deletes + st.Renewals + st.Nacks + st.Cleanups + st.Infos
}

type counters struct {
	commands, failures                                [cmdCount]atomic.Int64
	received, reclaimed, acked, ackedNotPending       atomic.Int64
	renewed, leaseLost, nacked, parked                atomic.Int64
	deleted, deletedWhileHeld, released, groupMissing atomic.Int64
}

// Stats returns the Source's counters.
func (s *Source) Stats() Stats {
	c := &s.stats
	st := Stats{
		Reads:            c.commands[cmdRead].Load(),
		Reclaims:         c.commands[cmdReclaim].Load(),
		Acks:             c.commands[cmdAck].Load(),
		Deletes:          c.commands[cmdDelete].Load(),
		Renewals:         c.commands[cmdExtend].Load(),
		Nacks:            c.commands[cmdNack].Load(),
		Cleanups:         c.commands[cmdCleanup].Load(),
		Infos:            c.commands[cmdInfo].Load(),
		Received:         c.received.Load(),
		Reclaimed:        c.reclaimed.Load(),
		Acked:            c.acked.Load(),
		AckedNotPending:  c.ackedNotPending.Load(),
		Renewed:          c.renewed.Load(),
		LeaseLost:        c.leaseLost.Load(),
		Nacked:           c.nacked.Load(),
		Parked:           c.parked.Load(),
		Deleted:          c.deleted.Load(),
		DeletedWhileHeld: c.deletedWhileHeld.Load(),
		Released:         c.released.Load(),
		GroupMissing:     c.groupMissing.Load(),
	}
	for i := range c.failures {
		st.Failures += c.failures[i].Load()
	}
	return st
}
