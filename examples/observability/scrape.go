package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// sample is one line of a Prometheus text exposition: a metric name, its
// labels and its value.
type sample struct {
	name   string
	labels map[string]string
	value  float64
}

// page is a scraped /metrics page.
type page []sample

// scrape reads the metrics page at url.
func scrape(ctx context.Context, url string) (page, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	// Ask for the text format: the parser below reads nothing else.
	req.Header.Set("Accept", "text/plain; version=0.0.4")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return parsePage(resp.Body)
}

// parsePage reads the Prometheus text format: comment lines are skipped,
// every other line is `name{label="value",...} value [timestamp]`.
func parsePage(r io.Reader) (page, error) {
	var p page
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		s, err := parseSample(line)
		if err != nil {
			return nil, fmt.Errorf("metrics page: %w: %q", err, line)
		}
		p = append(p, s)
	}
	return p, sc.Err()
}

func parseSample(line string) (sample, error) {
	s := sample{labels: map[string]string{}}
	rest := line
	if i := strings.IndexAny(line, "{ "); i < 0 {
		return s, fmt.Errorf("no value")
	} else {
		s.name, rest = line[:i], line[i:]
	}
	if rest[0] == '{' {
		rest = rest[1:]
		for {
			rest = strings.TrimLeft(rest, ", ")
			if strings.HasPrefix(rest, "}") {
				rest = rest[1:]
				break
			}
			eq := strings.Index(rest, `="`)
			if eq < 0 {
				return s, fmt.Errorf("malformed labels")
			}
			key := rest[:eq]
			rest = rest[eq+2:]
			var val strings.Builder
			for {
				if rest == "" {
					return s, fmt.Errorf("unterminated label value")
				}
				c := rest[0]
				rest = rest[1:]
				if c == '"' {
					break
				}
				if c == '\\' && rest != "" {
					c, rest = rest[0], rest[1:]
					if c == 'n' {
						c = '\n'
					}
				}
				val.WriteByte(c)
			}
			s.labels[key] = val.String()
		}
	}
	fields := strings.Fields(rest)
	if len(fields) == 0 {
		return s, fmt.Errorf("no value")
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, err
	}
	s.value = v
	return s, nil
}

// find returns the samples named name whose labels include want (given as
// key, value pairs).
func (p page) find(name string, want ...string) []sample {
	var out []sample
	for _, s := range p {
		if s.name != name {
			continue
		}
		ok := true
		for i := 0; i+1 < len(want); i += 2 {
			if s.labels[want[i]] != want[i+1] {
				ok = false
				break
			}
		}
		if ok {
			out = append(out, s)
		}
	}
	return out
}

// sum adds up the samples find returns, and reports whether there was any.
func (p page) sum(name string, want ...string) (float64, bool) {
	ss := p.find(name, want...)
	total := 0.0
	for _, s := range ss {
		total += s.value
	}
	return total, len(ss) > 0
}
