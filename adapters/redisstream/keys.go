package redisstream

import (
	"strings"

	"github.com/redis/go-redis/v9"
)

// hashTag returns the part of key that Redis Cluster hashes to pick its
// slot: the text between the first '{' and the first '}' after it when that
// is not empty, otherwise the whole key. Keys with the same hash tag are in
// the same slot, which a script touching several keys needs.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

// delaysKey names the sorted set that holds the due times of a group's
// entries given back with a delay longer than the lease. It hashes to the
// stream's slot, so the scripts that touch both work on a cluster: it
// keeps the stream's hash tag, or makes the stream's name its tag. It is
// false when neither is possible (a name with '}' but no hash tag).
func delaysKey(stream, group string) (string, bool) {
	suffix := ":custody-delays:" + group
	if hashTag(stream) != stream {
		return stream + suffix, true
	}
	key := "{" + stream + "}" + suffix
	return key, hashTag(key) == stream
}

// sameSlot reports whether the keys can be touched by one script through
// client: always on a single server, and on a cluster or a ring when their
// hash tags are equal.
func sameSlot(client redis.UniversalClient, a, b string) bool {
	if _, single := client.(*redis.Client); single {
		return true
	}
	return hashTag(a) == hashTag(b)
}
