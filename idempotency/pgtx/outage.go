package pgtx

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/custody-go/custody/consumer"
)

// Telling the database's failures (marked consumer.Unavailable: the message
// waits, using up no attempt) from the message's (unchanged: an attempt is
// used up); see the package documentation, section When the database fails.

// ownStatementFailed reports whether err, from a statement of the handler's
// own (BEGIN, the key's claim, the fingerprint read, COMMIT), is a failure
// of the database rather than of the data. Those statements are fixed and
// their key already checked, so any failure but a SQL error about the data
// (SQLSTATE classes 22 and 23, such as a deferred constraint at COMMIT) is
// the database's. Conflicts and the delivery's own context are handled
// before this.
func ownStatementFailed(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		class := pe.Code[:min(2, len(pe.Code))]
		return class != "22" && class != "23"
	}
	return true
}

// connectionLost reports whether the function's error err came with the
// transaction's connection gone: the server ended the session (terminated,
// shutting down, crashed) or the network dropped it, and pgx closed the
// connection. Nothing the function did can commit then, and the failure is
// the database's. An error of the function's own making leaves the
// connection open (a failed statement only aborts the transaction), and a
// network error from anything else the function calls (an HTTP request,
// say) says nothing about the database: those go to the runtime unchanged.
func connectionLost(tx pgx.Tx, err error) bool {
	if c := tx.Conn(); c != nil && c.IsClosed() {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code[:min(2, len(pe.Code))] {
		case "08": // connection exception
			return true
		case "57": // operator intervention: admin or crash shutdown, cannot connect now
			return pe.Code != "57014" // query_canceled: a statement timeout is the function's
		}
	}
	return false
}

// funcError is the error of a transaction (for what: "key ...", "a batch
// of n keys") whose function returned err, or nil over an aborted
// transaction (errAbortedTx). Conflicts, Permanent errors and the
// delivery's own end go to the runtime unchanged; see connectionLost for
// the others.
func funcError(ctx context.Context, tx pgx.Tx, err error, what string) error {
	if err == nil {
		return errAbortedTx
	}
	if ctx.Err() == nil && !isConflict(err) && !consumer.IsPermanent(err) && connectionLost(tx, err) {
		return consumer.Unavailable(fmt.Errorf("pgtx: %s: the connection to the database was lost while the function ran: %w", what, err))
	}
	return err
}

// ownStatementError marks err, from a statement of the handler's own after
// the function ran, consumer.Unavailable when the database failed.
func ownStatementError(ctx context.Context, err error) error {
	if ctx.Err() == nil && !isConflict(err) && ownStatementFailed(err) {
		return consumer.Unavailable(err)
	}
	return err
}

// errAbortedTx is the error of a function that returned nil with its
// transaction aborted by a statement that failed: nothing it did can
// commit. It is the function's failure, not the database's: marked
// unavailable (as the COMMIT's rollback would be), the message would wait
// for ever.
var errAbortedTx = errors.New("pgtx: the function returned nil, but a statement of its transaction had failed, which aborts the transaction; return that error, or run statements that may fail in a savepoint (tx.Begin) and roll it back")

// aborted reports whether tx's connection is open and its transaction
// aborted by a failed statement.
func aborted(tx pgx.Tx) bool {
	c := tx.Conn()
	return c != nil && !c.IsClosed() && c.PgConn().TxStatus() == 'E'
}
