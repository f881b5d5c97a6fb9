// Package pgsql holds what the PostgreSQL store and the transactional helper
// share: table-name checking and connection helpers for their tests.
package pgsql

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

var identifier = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Table is a checked, possibly schema-qualified table name.
type Table struct {
	// Quoted is the name quoted for SQL.
	Quoted string
	// Last is the unqualified name, unquoted, for naming indexes.
	Last string
}

// Index returns the quoted, unqualified name of an index on the table.
func (t Table) Index(suffix string) string { return pgx.Identifier{t.Last + "_" + suffix}.Sanitize() }

// ParseTable checks name ("name" or "schema.name", each part a plain SQL
// identifier) and quotes it.
func ParseTable(name string) (Table, error) {
	parts := strings.Split(name, ".")
	if len(parts) > 2 {
		return Table{}, fmt.Errorf("%q has more than one dot; use name or schema.name", name)
	}
	for _, p := range parts {
		if !identifier.MatchString(p) {
			return Table{}, fmt.Errorf("%q is not a plain SQL identifier (letters, digits and underscores, at most 63, not starting with a digit)", p)
		}
	}
	return Table{Quoted: pgx.Identifier(parts).Sanitize(), Last: parts[len(parts)-1]}, nil
}
