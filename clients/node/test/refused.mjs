// Connects without CURVE keys to a server that requires them, for tests/test_curve.py, as a loaded host can schedule
// it: the script held up right after the socket connects, while ZeroMQ meets the server's refusal (from then on the
// socket has no room). Usage: node test/refused.mjs ADDRESS
// Prints one JSON line: the error connect() ended with.
import { Client } from "../index.js";

const [address] = process.argv.slice(2);
const client = new Client({ address, connectTimeout: 2 });
const open = client._open.bind(client);
client._open = () => {
  open();
  const until = Date.now() + 10000; // ZeroMQ's own thread meets the refusal meanwhile (within milliseconds)
  while (client._sock.writable) {
    if (Date.now() > until) throw new Error("the server did not drop the connection within 10 s");
  }
};
let error = null;
try {
  await client.connect();
} catch (err) {
  error = { name: err.name, message: err.message };
}
client.close();
console.log(JSON.stringify({ error }));
