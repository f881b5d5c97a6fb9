package awssqs

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"io"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/sqs"
	"github.com/aws/aws-sdk-go-v2/service/sqs/types"

	"github.com/custody-go/custody/adapters"
)

// The fuzzers below check the adapter's pure parsers and codecs against a
// reference model or a round trip. Their seeds run with the package's tests;
// explore with, for example,
//
//	go test -run='^$' -fuzz=FuzzDeadLetterMessage -fuzztime=45s ./adapters/awssqs/

// FuzzParseRedrivePolicy checks parseRedrivePolicy against a model that walks
// the JSON object key by key: the policy is accepted exactly when the
// document is one JSON object whose deadLetterTargetArn (matched without
// regard to case, as encoding/json does; the last one wins) is a string or
// null, and whose maxReceiveCount is an integer of at least 1, written either
// as a JSON number or as a JSON string of decimal digits.
func FuzzParseRedrivePolicy(f *testing.F) {
	for _, s := range []string{
		`{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:dlq","maxReceiveCount":"5"}`,
		`{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:dlq","maxReceiveCount":5}`,
		`{"maxReceiveCount":"0"}`, `{"maxReceiveCount":-1}`, `{"maxReceiveCount":"x"}`,
		`{"maxReceiveCount":5.0}`, `{"maxReceiveCount":"\u0037"}`, `{"maxReceiveCount":"+7"}`,
		`{"maxReceiveCount":"99999999999999999999"}`, `{"maxReceiveCount":null}`,
		`{"MAXRECEIVECOUNT":3,"maxReceiveCount":4}`, `{"deadLetterTargetArn":7,"maxReceiveCount":1}`,
		`{"maxReceiveCount":1} x`, `[]`, `null`, `{`, ``, `"5"`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parseRedrivePolicy(s)
		arn, n, ok := redriveModel(s)
		if (err == nil) != ok {
			t.Fatalf("parseRedrivePolicy(%q): err %v, model accepts: %v (arn %q, count %d)", s, err, ok, arn, n)
		}
		if err != nil {
			if !strings.Contains(err.Error(), "RedrivePolicy") {
				t.Fatalf("error %q does not say which attribute is wrong", err)
			}
			return
		}
		if p.MaxReceiveCount != n || p.DeadLetterTargetArn != arn || p.MaxReceiveCount < 1 {
			t.Fatalf("parseRedrivePolicy(%q) = %+v, model says arn %q count %d", s, p, arn, n)
		}
	})
}

// redriveModel is the reference reading of a RedrivePolicy document.
func redriveModel(s string) (arn string, count int, ok bool) {
	dec := json.NewDecoder(strings.NewReader(s))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return "", 0, false
	}
	var rawCount json.RawMessage
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", 0, false
		}
		key := tok.(string)
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			return "", 0, false
		}
		switch {
		case strings.EqualFold(key, "deadLetterTargetArn"):
			if string(v) == "null" {
				continue // null leaves a string field alone
			}
			if err := json.Unmarshal(v, &arn); err != nil {
				return "", 0, false // a non-string ARN is a type error
			}
		case strings.EqualFold(key, "maxReceiveCount"):
			rawCount = v
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return "", 0, false
	}
	if _, err := dec.Token(); err != io.EOF {
		return "", 0, false // trailing data
	}
	digits := string(rawCount)
	if strings.HasPrefix(digits, `"`) {
		if err := json.Unmarshal(rawCount, &digits); err != nil {
			return "", 0, false
		}
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n < 1 {
		return "", 0, false
	}
	return arn, n, true
}

// fuzzAttributes decodes a list of message attributes from spec: entries
// separated by "\n", each a type letter (S String, N Number, B Binary, C a
// custom Binary.label), then NAME=VALUE. Names are unique and at most count
// entries are read.
func fuzzAttributes(spec string, count int) map[string]types.MessageAttributeValue {
	attrs := map[string]types.MessageAttributeValue{}
	for _, e := range strings.Split(spec, "\n") {
		if len(attrs) >= count || len(e) < 2 {
			continue
		}
		name, value, _ := strings.Cut(e[1:], "=")
		if _, dup := attrs[name]; dup {
			continue
		}
		switch e[0] {
		case 'B':
			attrs[name] = types.MessageAttributeValue{DataType: aws.String("Binary"), BinaryValue: []byte(value)}
		case 'C':
			attrs[name] = types.MessageAttributeValue{DataType: aws.String("Binary.gz"), BinaryValue: []byte(value)}
		case 'N':
			attrs[name] = types.MessageAttributeValue{DataType: aws.String("Number"), StringValue: aws.String(value)}
		default:
			attrs[name] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(value)}
		}
	}
	return attrs
}

// FuzzDelivery checks how a received message becomes a Delivery: every
// message attribute becomes one header, String and Number values unchanged
// and Binary ones in standard base64 that decodes back to the bytes; the
// attempt is ApproximateReceiveCount when it is an integer (else 0, which
// the runtime reads as 1); SentTimestamp gives PublishedAt to the
// millisecond; the group id is the Key, and the OrderingKey on FIFO queues.
func FuzzDelivery(f *testing.F) {
	f.Add("Strace=00-abc-01\nNprice=12.5\nBblob=\x00\xff\x10", "3", "1700000000123", "g1", true)
	f.Add("", "1", "0", "", false)
	f.Add("Sa=\nSa=dup\nCz=zz", "-2", "-5", "", true)
	f.Add("S=x\nBb=", "99999999999999999999", "x", "group", false)
	f.Add("Se=\xe2\x82", " 7", "9223372036854775807", "\xff", true)
	f.Fuzz(func(t *testing.T, spec, count, sent, group string, fifo bool) {
		attrs := fuzzAttributes(spec, 20)
		m := types.Message{
			MessageId:         aws.String("id-1"),
			ReceiptHandle:     aws.String("rh-1"),
			Body:              aws.String("body"),
			MessageAttributes: attrs,
			Attributes: map[string]string{
				string(types.MessageSystemAttributeNameApproximateReceiveCount): count,
				string(types.MessageSystemAttributeNameSentTimestamp):           sent,
				string(types.MessageSystemAttributeNameMessageGroupId):          group,
			},
		}
		s := &Source{name: "q", fifo: fifo}
		now := time.Unix(1_800_000_000, 0)
		d := s.delivery(m, now)

		if len(d.Headers) != len(attrs) {
			t.Fatalf("%d attributes became %d headers: %v", len(attrs), len(d.Headers), d.Headers)
		}
		for k, v := range attrs {
			h, ok := d.Headers[k]
			if !ok {
				t.Fatalf("attribute %q has no header", k)
			}
			if strings.HasPrefix(aws.ToString(v.DataType), "Binary") {
				b, err := base64.StdEncoding.DecodeString(h)
				if err != nil || !bytes.Equal(b, v.BinaryValue) {
					t.Fatalf("binary attribute %q = %q became header %q (decodes to %q, %v)", k, v.BinaryValue, h, b, err)
				}
			} else if h != aws.ToString(v.StringValue) {
				t.Fatalf("attribute %q = %q became header %q", k, aws.ToString(v.StringValue), h)
			}
		}

		wantAttempt := 0
		if n, err := strconv.ParseInt(count, 10, 0); err == nil {
			wantAttempt = int(n)
		}
		if d.Attempt != wantAttempt {
			t.Fatalf("ApproximateReceiveCount %q gave Attempt %d, want %d", count, d.Attempt, wantAttempt)
		}
		var wantSent time.Time
		if ms, err := strconv.ParseInt(sent, 10, 64); err == nil && ms > 0 {
			wantSent = time.UnixMilli(ms)
		}
		if !d.PublishedAt.Equal(wantSent) || d.PublishedAt.IsZero() != wantSent.IsZero() {
			t.Fatalf("SentTimestamp %q gave PublishedAt %v, want %v", sent, d.PublishedAt, wantSent)
		}
		if !d.PublishedAt.IsZero() && d.PublishedAt.UnixMilli() != wantSent.UnixMilli() {
			t.Fatalf("SentTimestamp %q does not round-trip: %d", sent, d.PublishedAt.UnixMilli())
		}
		wantOrdering := ""
		if fifo {
			wantOrdering = group
		}
		if d.Key != group || d.OrderingKey != wantOrdering {
			t.Fatalf("group %q (fifo %v) gave Key %q OrderingKey %q", group, fifo, d.Key, d.OrderingKey)
		}
		if d.ID != "id-1" || receipt(d) != "rh-1" || string(d.Body) != "body" || d.Queue != "q" || d.Partition != -1 || d.Offset != -1 || !d.ReceivedAt.Equal(now) {
			t.Fatalf("identity fields wrong: %+v", d)
		}
		if GroupID(d) != group {
			t.Fatalf("GroupID = %q, want %q", GroupID(d), group)
		}
	})
}

// FuzzDeadLetterMessage checks the dead-letter copy DeadLetter.message
// builds:
//   - it never has more than SQS's ten message attributes, and its size as
//     SQS counts it (body plus every attribute's name, type and value) is
//     within WithMaxMessageSize;
//   - the diagnostics attribute holds only characters SQS accepts in a
//     string value;
//   - every original attribute is either kept unchanged or carried inside
//     the diagnostics JSON as custody-original-attribute.NAME, and every
//     diagnostic header (adapters.Diagnostics plus the FIFO ids) decodes back
//     exactly (JSON coerces invalid UTF-8 to U+FFFD, and so does the model);
//     only the error text may be shortened, to a prefix, and only when the
//     whole copy did not fit;
//   - it fails only when even the error text cut to 64 bytes does not fit.
func FuzzDeadLetterMessage(f *testing.F) {
	many := ""
	for i := range 12 {
		many += "Sa" + strconv.Itoa(i) + "=v" + strconv.Itoa(i) + "\n"
	}
	f.Add([]byte("body"), "boom", "Strace=00-1-01\nBbin=\x00\x01", uint32(0), uint8(0), "g", "dedup")
	f.Add([]byte(strings.Repeat("b", 1500)), strings.Repeat("e", 1000), "", uint32(2048), uint8(1), "", "")
	f.Add([]byte(strings.Repeat("b", 2100)), "x", "", uint32(2048), uint8(0), "", "")
	f.Add([]byte("b"), strings.Repeat("é", 700), many, uint32(1024), uint8(3), "g", "")
	f.Add([]byte("b"), strings.Repeat("<\xff", 600), many+"Scustody-diagnostics=old", uint32(1200), uint8(2), "", "d")
	f.Add([]byte(""), "\uffff\ufffe\x00\u2028", "S\uffff=\ufffe", uint32(0), uint8(1), "\uffff", "")
	// The line above is the regression seed for raw U+FFFE/U+FFFF in the
	// diagnostics JSON, which SQS rejects (see escapeNonCharacters).
	f.Add([]byte("x"), "", many, uint32(1024), uint8(5), "", "")
	// A replayed copy: an earlier trip's diagnostics JSON (with attributes
	// and a body encoding that stay, diagnostics that go) and diagnostics
	// as plain attributes, native and foreign.
	replayed := `Scustody-diagnostics={"custody-error":"old","custody-original-attribute.big":"kept","custody-original-attribute.custody-attempts":"9",` +
		`"custody-original-attribute.":"x","custody-body-encoding":"base64","custody-original-group-id":"g0"}` +
		"\nScustody-error=stale\nScustody-original-partition=7\nScustody-original-routing-key=\nSbig=live\nSkept=yes"
	f.Add([]byte("AAE="), "new", replayed, uint32(0), uint8(0), "", "")
	f.Add([]byte("AAE="), "new", replayed, uint32(0), uint8(3), "", "")
	f.Add([]byte("AAE="), "new", replayed+"\n"+many, uint32(1100), uint8(8), "g", "d")
	f.Fuzz(func(t *testing.T, body []byte, errText, spec string, maxSize uint32, flags uint8, group, dedup string) {
		fifo, native, noErr := flags&1 != 0, flags&2 == 0, flags&4 != 0 // flags&8: small limit
		url := "https://sqs.us-east-1.amazonaws.com/1/dlq"
		if fifo {
			url += ".fifo"
		}
		var opts []DeadLetterOption
		switch {
		case maxSize == 0: // the default, 256 KiB
		case flags&8 != 0: // near the smallest limit, where shortening happens
			opts = append(opts, WithMaxMessageSize(1024+int(maxSize%2048)))
		default:
			opts = append(opts, WithMaxMessageSize(1024+int(maxSize%(1<<20-1024+1))))
		}
		q, err := newDeadLetter(noSender{}, url, opts)
		if err != nil {
			t.Fatal(err)
		}

		attrs := fuzzAttributes(spec, 14)
		d := &adapters.Delivery{ID: "mid-1", Body: body, Queue: "src", Partition: -1, Offset: -1,
			PublishedAt: time.Unix(1_700_000_000, 5e6), Handle: "rh-1"}
		if native {
			m := types.Message{MessageId: aws.String(d.ID), MessageAttributes: attrs, Attributes: map[string]string{}}
			if group != "" {
				m.Attributes[string(types.MessageSystemAttributeNameMessageGroupId)] = group
			}
			if dedup != "" {
				m.Attributes[string(types.MessageSystemAttributeNameMessageDeduplicationId)] = dedup
			}
			d.Native = m
			d.Key = group
		}
		lane := "" // another broker's lane: a Kafka partition or key
		if !native {
			lane = group
			d.OrderingKey = lane
		}
		// The diagnostics of an earlier trip the message carries, if its
		// diagnostics attribute (or header) holds a JSON object.
		var earlier map[string]string
		live := attrs // the message's own attributes (a foreign delivery's headers)
		if v, ok := attrs[q.attr]; ok {
			if json.Unmarshal([]byte(attributeString(v)), &earlier) != nil {
				earlier = nil
			}
		}
		// What the copy's body must be; a foreign delivery's refused
		// headers (added to want below) and body encoding.
		wantBody, encoding := string(body), ""
		var refused map[string]string
		if !native {
			// A delivery from elsewhere: its headers become String
			// attributes where SQS allows them (by the rules as AWS
			// documents them, modelled here with a regular expression),
			// the rest go into the diagnostics.
			d.Headers = map[string]string{}
			for k, v := range attrs {
				d.Headers[k] = attributeString(v)
			}
			attrs = map[string]types.MessageAttributeValue{}
			refused = map[string]string{}
			for k, v := range d.Headers {
				if modelAttributeName(k) && v != "" && invalidSQSChar(v) < 0 {
					attrs[k] = types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(v)}
				} else {
					refused[k] = v
				}
			}
			switch {
			case len(body) == 0:
				wantBody, encoding = " ", "empty"
			case invalidSQSChar(string(body)) >= 0:
				wantBody, encoding = base64.StdEncoding.EncodeToString(body), "base64"
			}
			group, dedup = "", ""
		}
		fail := adapters.Failure{Attempts: 5, Permanent: true, Consumer: "c",
			FirstFailure: time.Unix(1_700_000_001, 0), LastFailure: time.Unix(1_700_000_002, 7)}
		if !noErr {
			fail.Err = errors.New(errText)
		}

		// The diagnostics the copy must carry, before any shortening: an
		// earlier trip's are replaced, but the attributes that travelled in
		// them stay (unless the message has such an attribute again), and so
		// does the body encoding of a message received from SQS (its body is
		// the earlier copy's).
		want := adapters.Diagnostics(d, fail)
		for k, v := range earlier {
			name, ok := strings.CutPrefix(k, diagAttrPrefix)
			if _, again := live[name]; ok && name != "" && !staleName(name, q.attr) && !again {
				want[k] = v
			}
		}
		if e := earlier[diagBodyEncoding]; native && (e == "base64" || e == "empty") {
			want[diagBodyEncoding] = e
		}
		if group != "" {
			want[diagGroupID] = group
		}
		if dedup != "" {
			want[diagDedupID] = dedup
		}
		for k, v := range refused {
			if !staleName(k, q.attr) {
				want[diagAttrPrefix+k] = v
			}
		}
		if encoding != "" {
			want[diagBodyEncoding] = encoding
		}

		in, err := q.message(d, fail)
		if err != nil {
			// Justified only if the copy with the shortest error text
			// message may keep is still too large.
			min := maps(want)
			if e, ok := min[adapters.HeaderError]; ok && len(e) > minErrorTextKept {
				min[adapters.HeaderError] = validPrefix(strings.ToValidUTF8(e, ""), minErrorTextKept)
			}
			size := len(wantBody)
			for k, v := range attrs {
				if staleName(k, q.attr) {
					continue
				}
				if keptAttribute(attrs, k, q.attr) {
					size += len(k) + len(aws.ToString(v.DataType)) + len(aws.ToString(v.StringValue)) + len(v.BinaryValue)
				} else {
					min[diagAttrPrefix+k] = attributeString(v)
				}
			}
			size += len(q.attr) + len("String") + diagJSONSize(min)
			if size <= q.maxSize {
				t.Fatalf("message failed (%v) though a copy of %d bytes fits the %d limit", err, size, q.maxSize)
			}
			if !strings.Contains(err.Error(), "WithMaxMessageSize") {
				t.Fatalf("error %q does not say what to do", err)
			}
			return
		}

		if n := len(in.MessageAttributes); n > maxAttributes {
			t.Fatalf("copy has %d attributes, SQS allows %d", n, maxAttributes)
		}
		size := len(aws.ToString(in.MessageBody))
		for k, v := range in.MessageAttributes {
			size += len(k) + len(aws.ToString(v.DataType)) + len(aws.ToString(v.StringValue)) + len(v.BinaryValue)
		}
		if size > q.maxSize {
			t.Fatalf("copy is %d bytes, over the %d limit", size, q.maxSize)
		}
		if aws.ToString(in.MessageBody) != wantBody {
			t.Fatalf("body %q, want %q", aws.ToString(in.MessageBody), wantBody)
		}
		if !native {
			// Everything sent must be acceptable to SQS.
			if b := aws.ToString(in.MessageBody); b == "" || invalidSQSChar(b) >= 0 {
				t.Fatalf("body %q is not text SQS accepts", b)
			}
			for k, v := range in.MessageAttributes {
				if !modelAttributeName(k) || aws.ToString(v.StringValue) == "" || invalidSQSChar(aws.ToString(v.StringValue)) >= 0 {
					t.Fatalf("attribute %q = %q would be refused by SQS", k, aws.ToString(v.StringValue))
				}
			}
		}
		raw := aws.ToString(in.MessageAttributes[q.attr].StringValue)
		if i := invalidSQSChar(raw); i >= 0 {
			t.Fatalf("diagnostics attribute has a character SQS rejects at byte %d: %q", i, raw)
		}
		diag, err := DecodeDiagnostics(in.MessageAttributes, q.attr)
		if err != nil {
			t.Fatal(err)
		}

		for k, v := range attrs {
			if staleName(k, q.attr) {
				// Replaced by fresh diagnostics.
				if _, ok := in.MessageAttributes[k]; ok && k != q.attr {
					t.Fatalf("attribute %q of an earlier dead-letter trip kept in the copy", k)
				}
				continue
			}
			if got, ok := in.MessageAttributes[k]; ok {
				if aws.ToString(got.DataType) != aws.ToString(v.DataType) || aws.ToString(got.StringValue) != aws.ToString(v.StringValue) || !bytes.Equal(got.BinaryValue, v.BinaryValue) {
					t.Fatalf("attribute %q changed: %+v, was %+v", k, got, v)
				}
				continue
			}
			want[diagAttrPrefix+k] = attributeString(v)
		}

		wantJSON := map[string]string{}
		for k, v := range want {
			wantJSON[jsonCoerce(k)] = jsonCoerce(v)
		}
		for k, v := range wantJSON {
			got, ok := diag[k]
			if !ok {
				t.Fatalf("diagnostics lost %q: %v", k, diag)
			}
			if k == adapters.HeaderError && got != v {
				if size0 := fullSize(in, q.attr, want); size0 <= q.maxSize {
					t.Fatalf("error text shortened to %q though the whole copy (%d bytes) fits", got, size0)
				}
				if !strings.HasPrefix(strings.ToValidUTF8(want[k], ""), got) {
					t.Fatalf("shortened error text %q is not a prefix of %q", got, want[k])
				}
				continue
			}
			if got != v {
				t.Fatalf("diagnostic %q = %q, want %q", k, got, v)
			}
		}
		if len(diag) != len(wantJSON) {
			t.Fatalf("diagnostics have extra keys: %v, want %v", diag, wantJSON)
		}

		if fifo {
			g, id := aws.ToString(in.MessageGroupId), aws.ToString(in.MessageDeduplicationId)
			sqsGroup := func(s string) bool {
				return len(s) > 0 && len(s) <= 128 && strings.IndexFunc(s, func(r rune) bool { return r < '!' || r > '~' }) < 0
			}
			switch {
			case group != "" && g != group:
				t.Fatalf("MessageGroupId %q, original group %q", g, group)
			case group == "" && !sqsGroup(g):
				t.Fatalf("MessageGroupId %q is not one SQS accepts", g)
			case group == "" && lane == "" && g != id:
				t.Fatalf("MessageGroupId %q for a message without a group or lane; want a group of its own, its deduplication id %q", g, id)
			case lane != "" && sqsGroup(lane) && g != lane:
				t.Fatalf("MessageGroupId %q for lane %q; want the lane", g, lane)
			case lane != "" && !sqsGroup(lane) && !strings.HasPrefix(g, "custody-lane-"):
				t.Fatalf("MessageGroupId %q for lane %q, which SQS would refuse; want a digest of it", g, lane)
			}
			if len(id) != 64 || strings.Trim(id, "0123456789abcdef") != "" {
				t.Fatalf("MessageDeduplicationId %q is not 64 hex digits", id)
			}
		} else if in.MessageGroupId != nil || in.MessageDeduplicationId != nil {
			t.Fatalf("standard queue copy has FIFO ids")
		}
	})
}

// keptAttribute reports whether message keeps attribute k as an attribute:
// the first nine names in byte order, leaving out the diagnostics of an
// earlier trip (see staleName).
func keptAttribute(attrs map[string]types.MessageAttributeValue, k, diagAttr string) bool {
	smaller := 0
	for o := range attrs {
		if !staleName(o, diagAttr) && o < k {
			smaller++
		}
	}
	return smaller < maxAttributes-1
}

// staleName reports whether an attribute or header named name holds
// diagnostics of an earlier dead-letter trip, which the copy drops: the
// diagnostics attribute, or one of package adapters' diagnostic header names.
func staleName(name, diagAttr string) bool {
	return name == diagAttr || adapters.IsDiagnosticHeader(name)
}

// fullSize is the copy's size had the diagnostics diag not been shortened.
func fullSize(in *sqs.SendMessageInput, attr string, diag map[string]string) int {
	n := len(aws.ToString(in.MessageBody))
	for k, v := range in.MessageAttributes {
		if k != attr {
			n += len(k) + len(aws.ToString(v.DataType)) + len(aws.ToString(v.StringValue)) + len(v.BinaryValue)
		}
	}
	return n + len(attr) + len("String") + diagJSONSize(diag)
}

// diagJSONSize is the length of diag as JSON with U+FFFE and U+FFFF escaped
// (SQS rejects them raw; an escape takes three bytes more).
func diagJSONSize(diag map[string]string) int {
	js, err := json.Marshal(diag)
	if err != nil {
		panic(err)
	}
	return len(js) + 3*(bytes.Count(js, []byte("\uFFFE"))+bytes.Count(js, []byte("\uFFFF")))
}

func maps(m map[string]string) map[string]string {
	c := make(map[string]string, len(m))
	for k, v := range m {
		c[k] = v
	}
	return c
}

// validPrefix returns the longest prefix of valid UTF-8 s of at most n bytes
// that does not split a rune.
func validPrefix(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// jsonCoerce is what encoding/json makes of a string: each byte that is not
// part of valid UTF-8 becomes U+FFFD.
func jsonCoerce(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && n == 1 {
			b.WriteRune(utf8.RuneError)
		} else {
			b.WriteString(s[i : i+n])
		}
		i += n
	}
	return b.String()
}

// invalidSQSChar returns the byte index of the first character SQS rejects in
// a message body or string attribute (allowed: #x9 #xA #xD #x20-#xD7FF
// #xE000-#xFFFD #x10000-#x10FFFF), or -1.
func invalidSQSChar(s string) int {
	for i, r := range s {
		switch {
		case r == utf8.RuneError && !strings.HasPrefix(s[i:], "\uFFFD"):
			return i // invalid UTF-8
		case r == 0x9 || r == 0xA || r == 0xD:
		case r >= 0x20 && r <= 0xD7FF:
		case r >= 0xE000 && r <= 0xFFFD:
		case r >= 0x10000 && r <= 0x10FFFF:
		default:
			return i
		}
	}
	return -1
}

// FuzzDecodeDiagnostics checks that DecodeDiagnostics never panics, and that
// it reads back any string map encoded as JSON (String or Binary attribute).
func FuzzDecodeDiagnostics(f *testing.F) {
	f.Add(`{"custody-error":"boom","custody-attempts":"3"}`, false)
	f.Add(`{"a":1}`, true)
	f.Add(`null`, false)
	f.Add(``, true)
	f.Add(`{"a":"\ud800"}`, false)
	f.Fuzz(func(t *testing.T, raw string, binary bool) {
		v := types.MessageAttributeValue{DataType: aws.String("String"), StringValue: aws.String(raw)}
		if binary {
			v = types.MessageAttributeValue{DataType: aws.String("Binary"), BinaryValue: []byte(raw)}
		}
		got, err := DecodeDiagnostics(map[string]types.MessageAttributeValue{"d": v}, "d")
		var want map[string]string
		wantErr := json.Unmarshal([]byte(raw), &want)
		if (err == nil) != (wantErr == nil) {
			t.Fatalf("DecodeDiagnostics(%q): %v, json says %v", raw, err, wantErr)
		}
		if err == nil && len(got) != len(want) {
			t.Fatalf("DecodeDiagnostics(%q) = %v, want %v", raw, got, want)
		}
		for k, w := range want {
			if got[k] != w {
				t.Fatalf("DecodeDiagnostics(%q)[%q] = %q, want %q", raw, k, got[k], w)
			}
		}
		if _, err := DecodeDiagnostics(map[string]types.MessageAttributeValue{}, "d"); err == nil {
			t.Fatalf("a missing attribute decoded")
		}
		// Any map survives the round trip.
		if err == nil {
			js, _ := json.Marshal(got)
			back, err := DecodeDiagnostics(map[string]types.MessageAttributeValue{"d": {DataType: aws.String("String"), StringValue: aws.String(string(js))}}, "d")
			if err != nil || len(back) != len(got) {
				t.Fatalf("round trip of %v: %v, %v", got, back, err)
			}
			for k := range got {
				if back[k] != got[k] {
					t.Fatalf("round trip of %v: %v", got, back)
				}
			}
		}
	})
}

var attributeNameChars = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,256}$`)

// modelAttributeName is SQS's rule for message attribute names as AWS
// documents it, written independently of validAttributeName.
func modelAttributeName(k string) bool {
	l := strings.ToLower(k)
	return attributeNameChars.MatchString(k) && !strings.HasPrefix(k, ".") && !strings.HasSuffix(k, ".") &&
		!strings.Contains(k, "..") && !strings.HasPrefix(l, "aws.") && !strings.HasPrefix(l, "amazon.")
}
