// Streams greedy completions through the Node.js client while the test kills the server and starts it again, for
// tests/test_node_reattach.py. Usage: node test/reattach.mjs ADDRESS REATTACH_S MAX_TOKENS PROMPT...
// Prints one JSON line: each stream's text, its result's text, the longest pause between two of its pieces (s) and
// the error that ended it.
import { Client } from "../index.js";

const [address, reattach, maxTokens, ...prompts] = process.argv.slice(2);
const client = new Client({ address, timeout: 120, reattach: Number(reattach) });
await client.connect();

async function run(prompt) {
  const seen = { text: "", result: null, pause: 0, error: null };
  const stream = client.stream(prompt, { max_tokens: Number(maxTokens), temperature: 0 });
  let last = null;
  try {
    for await (const text of stream) {
      const now = performance.now();
      if (last !== null) seen.pause = Math.max(seen.pause, (now - last) / 1000);
      last = now;
      seen.text += text;
    }
    seen.result = stream.result.text;
  } catch (err) {
    seen.error = { name: err.name, code: err.code, message: err.message };
  }
  return seen;
}

const streams = await Promise.all(prompts.map(run));
client.close();
console.log(JSON.stringify(streams));
