package consumer

import (
	"context"
	"errors"
	"fmt"
	"reflect"

	"github.com/custody-go/custody/adapters"
)

// isNil reports whether v is nil or holds a nil pointer, func, map, channel,
// slice or interface: a typed nil, such as the value a constructor returns
// beside its error, which compares unequal to nil once stored in an
// interface.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	switch rv.Kind() {
	case reflect.Pointer, reflect.Func, reflect.Map, reflect.Chan, reflect.Slice, reflect.Interface, reflect.UnsafePointer:
		return rv.IsNil()
	}
	return false
}

// checkSource says what is wrong with src, if New cannot run it.
func checkSource(src adapters.Source) error {
	if src == nil {
		return errors.New("consumer.New: nil Source; pass an adapter such as memory.Broker.Source")
	}
	if isNil(src) {
		// rabbitmq.New failed and its error went unchecked: Capabilities
		// would dereference the nil pointer.
		return fmt.Errorf("consumer.New: the Source is a nil %T; check the error of the call that made it", src)
	}
	return nil
}

// checkHandler says what is wrong with h, if New cannot run it: every
// message would panic in it, and be dead-lettered for a wiring mistake.
func checkHandler(h Handler) error {
	switch h := h.(type) {
	case nil:
		return errors.New("consumer.New: nil Handler; pass the Handler that performs each message's effect (HandlerFunc adapts a function)")
	case HandlerFunc:
		if h == nil {
			return errors.New("consumer.New: nil HandlerFunc; pass the function that performs each message's effect")
		}
	case brokenChain:
		return fmt.Errorf("consumer.New: %w", h.err)
	}
	if isNil(h) {
		return fmt.Errorf("consumer.New: the Handler is a nil %T; check the error of the call that made it (a handler that needs no state can be a struct value)", h)
	}
	return nil
}

// brokenChain is the Handler Chain returns when given a nil Handler or
// Middleware, or when a Middleware returns a nil Handler: New refuses it
// with err. Should another wrapper hide it from New, each attempt fails
// with Unavailable(err): the messages wait, and none is dead-lettered, or
// lost, for a wiring mistake.
type brokenChain struct{ err error }

func (b brokenChain) Handle(context.Context, *Message) error { return Unavailable(b.err) }
