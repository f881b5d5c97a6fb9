// Package option applies functional options, the one way every custody
// package configures a value.
package option

// Apply calls each option on target, in order, and returns the first error.
// A nil option is skipped, so that a caller can build its list with
// options chosen at run time.
func Apply[T any, O ~func(T) error](target T, opts []O) error {
	for _, o := range opts {
		if o == nil {
			continue
		}
		if err := o(target); err != nil {
			return err
		}
	}
	return nil
}
