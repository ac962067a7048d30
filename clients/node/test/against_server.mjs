// Drives a running mpserve server through the Node.js client and prints what it saw as one JSON line, for
// tests/test_node_client.py. Usage: node test/against_server.mjs ADDRESS (a server serving `tiny` and the
// embedding model `emb`).
import { BadRequest, Client, MpserveError, UnknownModel } from "../index.js";

const client = new Client({ address: process.argv[2], timeout: 60 });
await client.connect();
const out = { models: client.models };
const prompt = "The quick brown fox";

const whole = await client.generate(prompt, { model: "tiny", max_tokens: 24, temperature: 0 });
out.whole = { id: whole.id, text: whole.text, finishReason: whole.finishReason, usage: whole.usage };

const stream = client.stream(prompt, { model: "tiny", max_tokens: 24, temperature: 0 });
const pieces = [];
for await (const text of stream) pieces.push(text);
out.streamed = { id: stream.id, pieces, text: stream.result.text };

const traced = await client.generate(prompt, { model: "tiny", max_tokens: 2, temperature: 0, requestId: "node-trace-1" });
out.tracedId = traced.id;

async function refusal(call) {
  try {
    await call();
    return null;
  } catch (err) {
    return { name: err.name, code: err.code, retryable: err.retryable, message: err.message,
      isMpserveError: err instanceof MpserveError, isBadRequest: err instanceof BadRequest,
      isUnknownModel: err instanceof UnknownModel };
  }
}
out.badRequest = await refusal(() => client.generate(prompt, { model: "tiny", max_tokens: 0 }));
out.unknownModel = await refusal(() => client.generate(prompt, { model: "no-such-model" }));

const long = client.stream(prompt, { model: "tiny", max_tokens: 100000 });
const it = long[Symbol.asyncIterator]();
await it.next(); // running: its first piece came
await client.cancel(long.id);
out.cancelled = await refusal(async () => { while (!(await it.next()).done); });

const tokens = await client.tokenize(prompt, { model: "tiny" });
out.tokens = tokens.tokens;
out.detokenized = await client.detokenize(tokens.tokens, { model: "tiny" });
const embedded = await client.embed(["hello", "world"], { model: "emb" });
out.embeddings = { rows: embedded.vectors.length, dim: embedded.vectors[0].length, promptTokens: embedded.promptTokens,
  norms: embedded.vectors.map((v) => Math.hypot(...v)) };
out.embedRefused = await refusal(() => client.embed("hello", { model: "tiny" }));

client.close();
console.log(JSON.stringify(out));
