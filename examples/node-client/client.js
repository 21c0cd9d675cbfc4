// Streams one completion from a kvmesh gateway: node client.js HOST:PORT "prompt" [max_tokens]
// Prints each text delta as it arrives, then one JSON line with the terminal event.
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTO_ROOT = path.join(__dirname, "..", "..", "protos");

function main() {
  const [address = "127.0.0.1:50051", prompt = "Hello!", maxTokens = "32"] =
    process.argv.slice(2);
  const definition = protoLoader.loadSync("kvmesh/v1/inference.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: false,
    oneofs: true,
  });
  const kvmesh = grpc.loadPackageDefinition(definition).kvmesh.v1;
  const client = new kvmesh.Inference(address, grpc.credentials.createInsecure());
  const request = {
    chat: { messages: [{ role: "user", content: prompt }] },
    sampling: { max_tokens: Number(maxTokens), temperature: 0 },
  };
  const deadline = new Date(Date.now() + 60000);
  const call = client.Generate(request, { deadline });
  let terminal = null;
  call.on("data", (event) => {
    if (event.event === "delta") {
      process.stdout.write(event.delta.text || ""); // proto3 defaults are left out
    } else if (["completed", "cancelled", "failed"].includes(event.event)) {
      terminal = { kind: event.event, body: event[event.event] };
    }
  });
  call.on("error", (error) => {
    console.error(`\nkvmesh error: ${error.code} ${error.details}`);
    process.exitCode = 2;
  });
  call.on("end", () => {
    process.stdout.write("\n" + JSON.stringify(terminal) + "\n");
    process.exitCode = terminal && terminal.kind === "completed" ? 0 : 2;
  });
}

main();
