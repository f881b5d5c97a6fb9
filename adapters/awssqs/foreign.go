package awssqs

import (
	"encoding/base64"
	"strings"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// A delivery from another broker can carry what SQS refuses (a binary body,
// header names SQS does not allow, empty header values); a refused copy
// would keep the original in its queue for good. These functions decide what
// is sent as it is and what travels in the diagnostics instead.

// diagBodyEncoding is the diagnostics key saying how the copy's body encodes
// the original's: "base64" when the original was not text SQS accepts,
// "empty" when it was empty (SQS refuses an empty body; the copy's is one
// space).
const diagBodyEncoding = "custody-body-encoding"

// foreignBody returns the body to send for a delivery not received from SQS
// and, when it had to be encoded, how.
func foreignBody(b []byte) (body, encoding string) {
	switch {
	case len(b) == 0:
		return " ", "empty"
	case isSQSText(b):
		return string(b), ""
	default:
		return base64.StdEncoding.EncodeToString(b), "base64"
	}
}

// isSQSText reports whether b is text SQS accepts in a body or a String
// attribute: valid UTF-8 of the characters #x9, #xA, #xD, #x20 to #xD7FF,
// #xE000 to #xFFFD and #x10000 to #x10FFFF.
func isSQSText(b []byte) bool {
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r == utf8.RuneError && n <= 1 {
			return false
		}
		if !sqsChar(r) {
			return false
		}
		b = b[n:]
	}
	return true
}

func sqsChar(r rune) bool {
	switch {
	case r == 0x9, r == 0xA, r == 0xD:
		return true
	case r >= 0x20 && r <= 0xD7FF:
		return true
	case r >= 0xE000 && r <= 0xFFFD:
		return true
	default:
		return r >= 0x10000 && r <= 0x10FFFF
	}
}

// validAttributeName reports whether SQS accepts name for a message
// attribute: 1 to 256 of A-Z, a-z, 0-9, '_', '-' and '.', no leading,
// trailing or doubled '.', and no "AWS." or "Amazon." prefix in any case.
func validAttributeName(name string) bool {
	if name == "" || len(name) > 256 || name[0] == '.' || name[len(name)-1] == '.' || strings.Contains(name, "..") {
		return false
	}
	lower := strings.ToLower(name)
	if strings.HasPrefix(lower, "aws.") || strings.HasPrefix(lower, "amazon.") {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-', c == '.':
		default:
			return false
		}
	}
	return true
}

// foreignAttributes splits a foreign delivery's headers into those SQS
// accepts as String attributes and those it would refuse, which the caller
// carries in the diagnostics.
func foreignAttributes(d *adapters.Delivery) (attrs map[string]types.MessageAttributeValue, refused map[string]string) {
	attrs = map[string]types.MessageAttributeValue{}
	for k, v := range d.Headers {
		if !validAttributeName(k) || v == "" || !isSQSText([]byte(v)) {
			if refused == nil {
				refused = map[string]string{}
			}
			refused[k] = v
			continue
		}
		attrs[k] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
	}
	return attrs, refused
}
