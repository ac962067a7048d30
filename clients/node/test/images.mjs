// Drives a running mpserve server that serves `vision` (a model with its image projector), or MODEL, through the
// Node.js client with one image or audio clip, and prints what it saw as one JSON line, for tests/test_images.py and
// tests/test_audio.py. Usage: node test/images.mjs ADDRESS IMAGE.png|CLIP.wav [MODEL]
import { readFileSync } from "node:fs";
import { Client, MEDIA_MARKER } from "../index.js";

const client = new Client({ address: process.argv[2], timeout: 60 });
await client.connect();
const prompt = `<|im_start|>user\nWhat is this?${MEDIA_MARKER}<|im_end|>\n<|im_start|>assistant\n`;
const result = await client.generate(prompt, { model: process.argv[4] ?? "vision",
  images: [readFileSync(process.argv[3])],
  max_tokens: 16, temperature: 0 });
client.close();
console.log(JSON.stringify({ text: result.text }));
