// Drives a running mpserve server that serves `tiny` with the LoRA adapters `fr` and `de` through the Node.js
// client, and prints what it saw as one JSON line, for tests/test_adapters_front.py. Usage: node
// test/adapters.mjs ADDRESS
import { Client, UnknownAdapter } from "../index.js";

const client = new Client({ address: process.argv[2], timeout: 60 });
await client.connect();
const out = {};
const greedy = { max_tokens: 8, temperature: 0 };
out.named = (await client.generate("hello", { model: "tiny:fr", ...greedy })).text;
out.chosen = (await client.generate("hello", { model: "tiny", adapters: { fr: 1 }, ...greedy })).text;
try {
  await client.generate("hello", { model: "tiny", adapters: ["es"], ...greedy });
} catch (err) {
  out.unknown = { code: err.code, isUnknownAdapter: err instanceof UnknownAdapter, message: err.message };
}
client.close();
console.log(JSON.stringify(out));
