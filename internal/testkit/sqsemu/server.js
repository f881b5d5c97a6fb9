// Starts the SQS emulator (npm package local-aws-sqs) for custody's tests.
//
//   node server.js [port]
//
// Port 0 (the default) picks a free port. Once the server listens it prints
// one line, "listening http://127.0.0.1:PORT", which package sqsemu waits
// for. The server exits when its standard input closes, so it never outlives
// the test binary that started it, even when that binary is killed.
"use strict";

const fs = require("fs");
const path = require("path");
const Module = require("module");

// local-aws-sqs 2.0.2 departs from SQS in two places that custody's tests
// rely on; the package is loaded with those expressions corrected:
//
//   - It increments a message's ApproximateReceiveCount on every
//     ChangeMessageVisibility, as if it were a receive; real SQS counts
//     receives only. A consumer that renews leases or nacks would then see
//     inflated attempt counts, and redrive policies would fire early. The
//     function that marks a message in flight takes a third argument that is
//     true exactly for visibility changes.
//   - Its ApproximateNumberOfMessages counts the messages in flight too; SQS
//     counts the messages available for retrieval (visible, not delayed),
//     and reports those in flight apart, as
//     ApproximateNumberOfMessagesNotVisible. A backlog read from both would
//     count every message in flight twice.
//
// The package is pinned, so the text is known; refuse to start if it is not
// there rather than run an emulator that counts wrong.
const corrections = [
  {
    wrong: "Wt=function(t,e,i){if(!t)return;let r=this.VisibilityTimeout*1e3;typeof e==\"number\"&&!isNaN(e)&&(r=e*1e3);let n=Number(t.record.attributes.ApproximateReceiveCount)+1;",
    from: "ApproximateReceiveCount)+1;",
    to: "ApproximateReceiveCount)+(i?0:1);",
  },
  {
    wrong: "ApproximateNumberOfMessages:String(S(this,E).filter(o=>!o.delayed).length)",
    from: "!o.delayed)",
    to: "!o.delayed&&o.visible)",
  },
];

function loadEmulator() {
  const file = require.resolve("local-aws-sqs");
  let src = fs.readFileSync(file, "utf8");
  for (const c of corrections) {
    if (!src.includes(c.wrong)) {
      throw new Error(`${file} is not the local-aws-sqs 2.0.2 this script patches; update server.js with the package`);
    }
    src = src.replace(c.wrong, c.wrong.replace(c.from, c.to));
  }
  const m = new Module(file, module);
  m.filename = file;
  m.paths = Module._nodeModulePaths(path.dirname(file));
  m._compile(src, file);
  return m.exports;
}

const { createSqsServer } = loadEmulator();

const port = Number(process.argv[2] || 0);

createSqsServer({
  port,
  hostname: "127.0.0.1",
  // Tests delete and re-create queues with the same name freely.
  emulateQueueCreationLifecycle: false,
}).then((server) => {
  server.on("error", (err) => {
    console.error(err);
    process.exit(1);
  });
  process.stdout.write(`listening http://127.0.0.1:${server.address().port}\n`);
}, (err) => {
  console.error(err);
  process.exit(1);
});

process.stdin.on("end", () => process.exit(0));
process.stdin.on("error", () => process.exit(0));
process.stdin.resume();
