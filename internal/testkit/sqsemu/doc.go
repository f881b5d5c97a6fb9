// Package sqsemu runs an SQS emulator for custody's tests and benchmarks.
//
// The emulator is the npm package local-aws-sqs, pinned in this directory's
// package.json and package-lock.json. It speaks the JSON protocol current
// aws-sdk-go-v2 clients use, with visibility timeouts, batch calls, redrive
// policies and FIFO queues.
//
// # Starting it
//
// [Start] returns the endpoint of an emulator shared by the whole test
// binary: the first call installs the npm package when node_modules is
// missing (npm ci, so a fresh clone needs only node and npm on the PATH),
// starts node on a free loopback port and waits until it answers. Tests keep
// out of each other's way by creating queues with unique names
// ([QueueName]). A test binary that uses the emulator stops it at exit with
//
//	func TestMain(m *testing.M) { os.Exit(sqsemu.Run(m)) }
//
// and the emulator also exits by itself when its standard input closes, so it
// never outlives a test binary that was killed.
//
// When node or npm is missing, or the emulator cannot start, Start calls
// testbroker.Unavailable: the test is skipped on a laptop and fails in CI
// (CUSTODY_REQUIRE_BROKERS=1).
//
// # Counting requests
//
// SQS bills per request, so tests and benchmarks measure requests per
// message. [NewClient] builds an SQS client for the emulator whose HTTP
// transport is a [Counter], which counts requests per SQS operation.
package sqsemu
