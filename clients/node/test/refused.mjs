// Connects without CURVE keys to a server that requires them, for tests/test_curve.py, as a loaded host can schedule
// it: the script held up right after the socket connects while ZeroMQ meets the server's refusal, which leaves the
// socket no connection and no room for good; that state made certain. Usage: node test/refused.mjs ADDRESS
// Prints one JSON line: the error connect() ended with.
import { Client } from "../index.js";

const [address] = process.argv.slice(2);
const client = new Client({ address, connectTimeout: 2 });
const open = client._open.bind(client);
client._open = () => {
  open();
  client._sock.disconnect(address); // the state a refusal leaves the socket in (no connection, no room), made certain
};
let error = null;
try {
  await client.connect();
} catch (err) {
  error = { name: err.name, message: err.message };
}
client.close();
console.log(JSON.stringify({ error }));
