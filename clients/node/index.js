// A Node.js client for mpserve, written from its protocol specification (docs/protocol.md): one ZeroMQ DEALER
// socket carries any number of concurrent requests; answers are sorted by request id.
//
//   generate/stream/tokenize/embed ──send queue (one send at a time)──▶ DEALER ──▶ broker (ROUTER)
//   receive loop: [MPS1, TYPE, BODY] ──▶ the pending request of BODY.id (CHUNKS: each chunk's id)
//   keep-alive: PING every second while requests are pending; 3 s without a message: the server is gone
//
// When the server is gone, the other calls fail at once and the completions reattach (protocol.md's Reattach, as
// the Python client does) for `reattach` seconds (0: they fail at once), unless a local server was stopped (its
// socket file and NAME.link are gone; one that died leaves NAME.link). Each is sent again, marked `reattach`, on a
// new DEALER after each silence, or on the same one when a PONG names another server start; the server streams its
// whole text so far (it adopted the request) or runs it anew, and the text each choice delivered already is dropped
// as it comes again, checked equal (an unseeded sampled request that ran anew differs: ConnectionFailed):
//
//   CHUNK ──▶ Track.fresh: the part past what its choice delivered ──▶ the pending request's queue
//   silence ──▶ _reattach: new DEALER, each completion sent again, every choice's text to be seen again
//   PONG of another start ──▶ _restarted: each completion it may lack sent again (one sent to the start before, or
//                              sent on a new DEALER and not answered since: another listener may have taken it)
//
// Errors are MpserveError subclasses carrying the wire's `code` and whether a retry may succeed (`retryable`).

import { decode, encode } from "@msgpack/msgpack";
import { randomBytes } from "node:crypto";
import { existsSync, readFileSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import * as zmq from "zeromq";

export const VERSION = Buffer.from("MPS1");
export const MAX_ID_CHARS = 64;
export const MAX_MESSAGE_BYTES = 4 * 1024 * 1024;
export const MEDIA_MARKER = "<__media__>"; // where an image goes in a prompt's text (`images`)
/** The sampling parameters a request takes, in the protocol's order (GenerateParams; a test compares them). */
export const SAMPLING_PARAMS = Object.freeze([
  "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "repeat_penalty", "presence_penalty",
  "frequency_penalty", "logit_bias", "min_p", "typical_p", "ignore_eos", "logprobs", "grammar", "json_schema",
  "prompt_logprobs", "n", "speculative_n_max", "reasoning_end", "reasoning_budget", "reasoning_effort",
]);
const PING_INTERVAL_MS = 1000;
const PING_LIVENESS = 3;
const QUIET_PING_MS = 250; // ... and pings this often once it has heard nothing that long: a restarted server answers soon
const CONNECT_TIMEOUT_MS = 5000;
const REATTACH_S = 30; // how long completions wait for a server to come back after it went silent

export const MsgType = Object.freeze({
  REQUEST: 0x01, CANCEL: 0x02, PING: 0x03, STATS_QUERY: 0x04, TOKENIZE: 0x05, CONTROL: 0x06, EMBED: 0x07,
  SLOT_ACTION: 0x08, CHUNK: 0x10, DONE: 0x11, ERROR: 0x12, PONG: 0x13, STATS: 0x14, TOKENS: 0x15,
  CONTROL_REPLY: 0x16, EMBEDDINGS: 0x17, CHUNKS: 0x18, SLOT_REPLY: 0x19,
});

// --- errors: one class per code of the protocol's error table ----------------------------------------------

export class MpserveError extends Error {
  constructor(code, message, { retryable = false, retryAfter = null, requestId = null } = {}) {
    super(`[${code}] ${message}`);
    this.name = this.constructor.name;
    this.code = code;
    this.retryable = retryable;
    this.retryAfter = retryAfter;
    this.requestId = requestId;
  }
}

// code: [class name, retryable]
export const CODES = Object.freeze({
  bad_request: ["BadRequest", false],
  unknown_model: ["UnknownModel", false],
  unknown_adapter: ["UnknownAdapter", false],
  busy: ["Busy", true],
  timeout: ["Timeout", true],
  cancelled: ["Cancelled", false],
  grammar_too_complex: ["GrammarTooComplex", false],
  worker_lost: ["WorkerLost", true],
  worker_stalled: ["WorkerStalled", true],
  poison_request: ["PoisonRequest", false],
  model_failed: ["ModelFailed", false],
  no_instance: ["NoInstance", true],
  does_not_fit: ["DoesNotFit", false],
  shutting_down: ["ShuttingDown", true],
  connection: ["ConnectionFailed", true],
  protocol: ["ProtocolError", false],
  forbidden: ["Forbidden", false],
  config: ["ConfigError", false],
  internal: ["InternalError", false],
});

export const errors = {};
for (const [code, [name, retryable]] of Object.entries(CODES)) {
  errors[name] = {
    [name]: class extends MpserveError {
      constructor(message, options = {}) {
        super(code, message, { ...options, retryable });
      }
    },
  }[name];
}
export const {
  BadRequest, UnknownModel, UnknownAdapter, Busy, Timeout, Cancelled, WorkerLost, WorkerStalled, PoisonRequest,
  ModelFailed, NoInstance, DoesNotFit, ShuttingDown, ConnectionFailed, ProtocolError, ConfigError, InternalError,
} = errors;

/** The exception for an ERROR body; an unknown code (a newer server) is a plain, non-retryable MpserveError. */
export function errorFromWire(body) {
  const known = CODES[body.code];
  const options = { retryAfter: body.retry_after ?? null, requestId: body.id ?? null };
  return known ? new errors[known[0]](body.message, options) : new MpserveError(body.code, body.message, options);
}

// --- ids, tokens, addresses -------------------------------------------------------------------------------

/** Request ids no other client makes: a random 64-bit prefix, then a counter (hex), as the protocol advises. */
export function requestIds() {
  const prefix = randomBytes(8).toString("hex");
  let n = 0;
  return () => `${prefix}.${(++n).toString(16)}`;
}

export function packTokens(tokens) {
  const out = Buffer.alloc(4 * tokens.length);
  tokens.forEach((t, i) => out.writeInt32LE(t, 4 * i));
  return out;
}

export function unpackTokens(bytes) {
  const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  return Array.from({ length: buf.length / 4 }, (_, i) => buf.readInt32LE(4 * i));
}

function unpackVectors(bytes, dim) {
  const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const rows = [];
  for (let off = 0; off < buf.length; off += 4 * dim) {
    rows.push(Array.from({ length: dim }, (_, i) => buf.readFloatLE(off + 4 * i)));
  }
  return rows;
}

/** The address of the local server `name`, as mpserve's own clients find it (its runtime directory). */
export function defaultAddress(name = "default") {
  if (process.env.MPSERVE_ADDRESS) return process.env.MPSERVE_ADDRESS;
  const runtime = process.env.MPSERVE_RUNTIME_DIR
    || (process.env.XDG_RUNTIME_DIR ? join(process.env.XDG_RUNTIME_DIR, "mpserve") : `/tmp/mpserve-${process.getuid()}`);
  return `ipc://${join(runtime, `${name}.sock`)}`;
}

/** The Z85 keys of a ZeroMQ certificate file (made by `mpserve keygen`). */
export function readCertificate(path) {
  const text = readFileSync(path.replace(/^~/, homedir()), "utf8");
  const key = (name) => (text.match(new RegExp(`${name}\\s*=\\s*"([^"]+)"`)) || [])[1] || null;
  return { publicKey: key("public-key"), secretKey: key("secret-key") };
}

// --- the client -------------------------------------------------------------------------------------------

/**
 * new Client({ address, serverName, timeout, connectTimeout, curveServerKey, curveSecret, reattach })
 *   address: a ZeroMQ address (default: the local server `serverName`, as `mpserve start` binds it)
 *   timeout: seconds per request, queueing included (default: none)
 *   reattach: seconds the completions in flight wait for a server that went silent to come back (the same one
 *     restarted, adopting the instances that ran them); 0: they fail at the first silence (default 30)
 *   curveServerKey / curveSecret: certificate files for a server bound to the network with CURVE
 */
export class Client {
  constructor({ address, serverName = "default", timeout = null, connectTimeout = CONNECT_TIMEOUT_MS / 1000,
    curveServerKey = null, curveSecret = null, reattach = REATTACH_S } = {}) {
    this.address = address || defaultAddress(serverName);
    this.timeout = timeout;
    this.connectTimeout = connectTimeout;
    this.reattach = reattach;
    this.models = [];
    this.maxMessageBytes = MAX_MESSAGE_BYTES;
    this._curve = curveKeys(curveServerKey, curveSecret);
    this._ids = requestIds();
    this._pending = new Map(); // id -> the Queue of its answers
    this._tracks = new Map(); // id -> the Track of a pending completion (what a reattach needs)
    this._sends = Promise.resolve();
    this._sock = null;
    this._lastHeard = 0;
    this._pinged = 0; // the last PING's time, and the last reattach's: pings are more frequent than reattaches
    this._reattached = 0;
    this._silentSince = null; // the server went silent then, and has not answered since
    this._server = ""; // the start of the server answering (its PONGs say), "" until one did
    this._pong = null;
    this._timer = null;
  }

  async connect() {
    if (this._sock) return this;
    if (this.address.startsWith("ipc://") && !existsSync(this.address.slice("ipc://".length))) {
      throw new ConnectionFailed(`no server is listening at ${this.address}; start one with \`mpserve start\``);
    }
    this._open();
    const pong = new Promise((resolve) => { this._pong = resolve; });
    // not awaited: a server that refuses this client's CURVE keys drops the connection, and the socket has no room
    // from then on (a ping sent after that waits for good); the answer's wait is the bound
    this._send(MsgType.PING, { nonce: 0 }).catch(() => {});
    const answered = await Promise.race([pong.then(() => true), sleep(this.connectTimeout * 1000).then(() => false)]);
    if (!answered) {
      this.close();
      const hint = this.address.startsWith("tcp://") ? " and does it accept your CURVE keys?" : "?";
      throw new ConnectionFailed(`no answer from a server at ${this.address} within ${this.connectTimeout} s; `
        + `is \`mpserve start\` running${hint}`);
    }
    this._timer = setInterval(() => this._keepAlive(), QUIET_PING_MS);
    this._timer.unref();
    return this;
  }

  close() {
    clearInterval(this._timer);
    this._timer = null;
    this._failAll(new ConnectionFailed("the client was closed"));
    if (this._sock) {
      this._sock.close();
      this._sock = null;
    }
  }

  /** One completion: { id, text, finishReason, usage, timings, worker }. `params`: the wire's names. `adapters`:
   * the model's LoRA adapters to apply, { name: scale } or [name, ...] (scale 1); a `model` of BASE:NAME applies
   * NAME too. `images`: encoded images (PNG, JPEG, GIF, BMP) and audio clips (WAV, MP3), Buffers, each where the
   * prompt's next MEDIA_MARKER is, for a model served with its projector. */
  async generate(prompt, { model = null, timeout = null, requestId = null, adapters = null, images = null,
    ...params } = {}) {
    const stream = this.stream(prompt, { model, timeout, requestId, adapters, images, ...params, stream: false });
    for await (const _ of stream); // eslint-disable-line no-unused-vars
    return stream.result;
  }

  /** A streamed completion: `for await (const text of client.stream(...))`; then `stream.result`. */
  stream(prompt, { model = null, timeout = null, requestId = null, stream = true, adapters = null, images = null,
    ...params } = {}) {
    return new Stream(this, this._request(prompt, model, timeout, requestId, params, stream, adapters, images));
  }

  /** Stop request `id` (queued or running); its stream ends with a Cancelled error. */
  async cancel(id) {
    await this.connect();
    await this._send(MsgType.CANCEL, { id });
  }

  /** `text` in the model's tokens: { tokens }. */
  async tokenize(text, { model = null, addSpecial = false, timeout = null } = {}) {
    const answer = await this._ask(MsgType.TOKENIZE, { model, text, add_special: addSpecial, timeout: timeout ?? this.timeout });
    return { tokens: unpackTokens(answer.tokens) };
  }

  /** The text of token ids. */
  async detokenize(tokens, { model = null, timeout = null } = {}) {
    const answer = await this._ask(MsgType.TOKENIZE, { model, tokens: packTokens(tokens), detokenize: true,
      timeout: timeout ?? this.timeout });
    return answer.text;
  }

  /** Embeddings of a text, texts, or arrays of token ids: { vectors, promptTokens }. */
  async embed(inputs, { model = null, timeout = null, requestId = null } = {}) {
    const items = typeof inputs === "string" || (inputs.length && inputs.every(Number.isInteger)) ? [inputs] : inputs;
    const texts = items.filter((i) => typeof i === "string");
    const arrays = items.filter(Array.isArray).map(packTokens);
    if (texts.length + arrays.length !== items.length || (texts.length && arrays.length)) {
      throw new BadRequest("'input' must be a text, a list of texts, a list of token ids or a list of those lists");
    }
    const body = { model, timeout: timeout ?? this.timeout, ...(texts.length ? { texts } : { tokens: arrays }) };
    const answer = await this._ask(MsgType.EMBED, body, requestId);
    return { vectors: unpackVectors(answer.vectors, answer.dim), promptTokens: answer.prompt_tokens ?? 0 };
  }

  // --- internals ------------------------------------------------------------------------------------------

  _request(prompt, model, timeout, requestId, params, stream, adapters = null, images = null) {
    const id = requestId ?? this._ids();
    if (typeof id !== "string" || id.length === 0 || id.length > MAX_ID_CHARS) {
      throw new BadRequest(`a request id is a string of 1 to ${MAX_ID_CHARS} characters`);
    }
    const unknown = Object.keys(params).filter((key) => !SAMPLING_PARAMS.includes(key));
    if (unknown.length) {
      throw new BadRequest(`unknown parameter(s) ${unknown.join(", ")}; allowed: ${SAMPLING_PARAMS.join(", ")}`);
    }
    if (params.stop !== undefined && !Array.isArray(params.stop)) params.stop = [params.stop];
    if (params.logit_bias && !Array.isArray(params.logit_bias)) {  // OpenAI's map: the wire's [token id, bias] pairs
      params.logit_bias = Object.entries(params.logit_bias).map(([token, bias]) => [Number(token), bias]);
    }
    const [base, chosen] = adapterSelection(model, adapters);
    const body = { id, prompt: typeof prompt === "string" ? prompt : "", model: base, params, stream,
      timeout: timeout ?? this.timeout };
    if (typeof prompt !== "string") body.tokens = packTokens(prompt);
    if (chosen.length) body.adapters = chosen;
    if (images && images.length) body.images = images.map((image) => Buffer.from(image));
    return body;
  }

  /** A new DEALER socket, connected (ZeroMQ connects in the background: to an address nobody listens on yet too),
   * its messages received. */
  _open() {
    const sock = new zmq.Dealer({ linger: 0 });
    if (this._curve) {
      sock.curveServerKey = this._curve.serverKey;
      sock.curvePublicKey = this._curve.publicKey;
      sock.curveSecretKey = this._curve.secretKey;
    }
    sock.connect(this.address);
    this._sock = sock;
    this._lastHeard = Date.now();
    this._receive(sock);
  }

  /** Register `id` and return the queue its answers arrive in. */
  _claim(id) {
    if (this._pending.has(id)) {
      throw new BadRequest(`request id '${id}' is already in use by a pending request of this client`);
    }
    const queue = new Queue();
    this._pending.set(id, queue);
    return queue;
  }

  async _submit(body) {
    await this.connect();
    const queue = this._claim(body.id);
    this._tracks.set(body.id, new Track(body, this._server));
    try {
      await this._send(MsgType.REQUEST, body);
    } catch (err) {
      this._forget(body.id);
      throw err;
    }
    return queue;
  }

  /** A request ended: whether it was still pending. */
  _forget(id) {
    this._tracks.delete(id);
    return this._pending.delete(id);
  }

  async _ask(type, body, requestId = null) {
    await this.connect();
    const id = requestId ?? this._ids();
    const queue = this._claim(id);
    const wait = body.timeout == null ? null : body.timeout * 1000 + 1000;
    try {
      await this._send(type, { id, ...body });
      const answer = await queue.next(wait);
      if (answer === TIMED_OUT) throw new Timeout(`no answer within ${body.timeout} s`, { requestId: id });
      if (answer.type === MsgType.ERROR) throw answer.error ?? errorFromWire(answer.body);
      return answer.body;
    } finally {
      this._pending.delete(id);
    }
  }

  _send(type, body) {
    const packed = encode(dropNulls(body));
    if (packed.length > this.maxMessageBytes) {
      return Promise.reject(new BadRequest(`the request is ${packed.length} bytes encoded; the server takes messages `
        + `of at most ${this.maxMessageBytes} bytes (MAX_MESSAGE_BYTES)`));
    }
    const sock = this._sock;
    const sent = this._sends.then(() => sock.send([VERSION, Buffer.from([type]), packed]));
    this._sends = sent.catch(() => {});
    return sent;
  }

  async _receive(sock) {
    try {
      for await (const frames of sock) {
        this._lastHeard = Date.now();
        this._silentSince = null;
        this._dispatch(frames);
      }
    } catch (err) {
      if (this._sock === sock) this._failAll(new ConnectionFailed(`the socket failed: ${err.message}`));
    }
  }

  _dispatch(frames) {
    if (frames.length !== 3 || !VERSION.equals(frames[0]) || frames[1].length !== 1) return; // not MPS1: ignored
    const type = frames[1][0];
    let body;
    try {
      body = decode(frames[2]);
    } catch {
      return;
    }
    if (type === MsgType.PONG) {
      this.models = body.models ?? [];
      if (body.max_message_bytes) this.maxMessageBytes = body.max_message_bytes;
      if (this._pong) this._pong();
      if (body.server && body.server !== this._server) this._restarted(body.server);
      return;
    }
    const chunks = type === MsgType.CHUNK || type === MsgType.CHUNKS;
    for (const one of type === MsgType.CHUNKS ? body : [body]) {
      const queue = one && this._pending.get(one.id);
      if (!queue) continue;
      const tracked = this._tracks.get(one.id);
      if (tracked) tracked.heard = true;
      const track = chunks && tracked;
      if (!track) {
        queue.push({ type: chunks ? MsgType.CHUNK : type, body: one });
        continue;
      }
      let text;
      try {
        text = track.fresh(one.index ?? 0, one.text);
      } catch (error) {
        this._forget(one.id);
        queue.push({ type: MsgType.ERROR, error });
        continue;
      }
      if (text) queue.push({ type: MsgType.CHUNK, body: { ...one, text } });
    }
  }

  /** While requests are pending: ping every second (every QUIET_PING_MS while the server is silent); after
   * PING_LIVENESS s of silence, reattach the completions (again after each silence, for `reattach` s) and fail the
   * rest. */
  _keepAlive() {
    const now = Date.now();
    if (!this._sock || this._pending.size === 0) {
      this._lastHeard = now;
      this._silentSince = null;
      return;
    }
    if (now - this._lastHeard <= PING_INTERVAL_MS * PING_LIVENESS) {
      if (now - this._pinged >= (now - this._lastHeard < QUIET_PING_MS ? PING_INTERVAL_MS : QUIET_PING_MS)) {
        this._pinged = now;
        this._send(MsgType.PING, { nonce: 0 }).catch(() => {});
      }
      return;
    }
    if (now - this._reattached < PING_INTERVAL_MS) return;
    this._reattached = now;
    const first = this._silentSince === null;
    const since = this._silentSince ??= this._lastHeard;
    const error = new ConnectionFailed(`the server at ${this.address} stopped answering (`
      + `${((now - since) / 1000).toFixed(1)} s of silence)`);
    const completions = [...this._pending.keys()].filter((id) => this._tracks.has(id));
    if (!completions.length || now - since > this.reattach * 1000 || (first && this._stopped())) {
      this._failAll(error);
      return;
    }
    for (const [id, queue] of this._pending) {
      if (!this._tracks.has(id)) {
        this._pending.delete(id);
        queue.push({ type: MsgType.ERROR, error });
      }
    }
    this._reattach(completions);
  }

  /** Whether the local server at an ipc address of NAME.sock was stopped, not killed: a stop removes its socket and
   * its secret file NAME.link; a server that died leaves NAME.link, which its next start rewrites (its socket may be
   * missing while it starts). A server at another address is waited for (the reattach bound). */
  _stopped() {
    if (!this.address.startsWith("ipc://")) return false;
    const socketFile = this.address.slice("ipc://".length);
    if (!socketFile.endsWith(".sock") || existsSync(socketFile)) return false;
    return !existsSync(`${socketFile.slice(0, -".sock".length)}.link`);
  }

  /** The server answering is another start than the one the pending completions were sent to (ZeroMQ reconnected
   * to it before any silence showed): they are sent to it again, marked `reattach`. So is one sent on a new
   * connection and not answered since: that connection may have met another listener first, which dropped it (a
   * server that died as it started); a start that has it already ignores the copy. */
  _restarted(server) {
    const first = !this._server;
    this._server = server;
    const again = [];
    for (const [id, track] of this._tracks) {
      if (track.server === null) { // sent again on a new connection, to whichever start took it
        track.server = server;
        if (!track.heard) again.push(id);
      } else if (track.server !== server) again.push(id);
    }
    if (!first && again.length && this.reattach) this._reattach(again, false);
  }

  /** Connect afresh (`reconnect`: a new DEALER) and send each completion again, marked `reattach`; the text each
   * choice delivered is to be seen again before anything new (Track). */
  _reattach(ids, reconnect = true) {
    if (reconnect) {
      const old = this._sock;
      this._open();
      old.close();
    }
    for (const id of ids) {
      const track = this._tracks.get(id);
      track.reattached(reconnect ? null : this._server);
      this._send(MsgType.REQUEST, { ...track.body, reattach: true }).catch(() => {}); // failed: silence fails it
    }
  }

  _failAll(error) {
    for (const queue of this._pending.values()) queue.push({ type: MsgType.ERROR, error });
    this._pending.clear();
    this._tracks.clear();
  }
}

/** A streamed request: an async iterator of text pieces; `id` is its request id, `result` its DONE. */
export class Stream {
  constructor(client, body) {
    this.client = client;
    this.id = body.id;
    this.result = null;
    this._body = body;
  }

  async *[Symbol.asyncIterator]() {
    const queue = await this.client._submit(this._body);
    const wait = this._body.timeout == null ? null : this._body.timeout * 1000 + 1000;
    let ended = false; // a terminal message came: nothing to cancel
    try {
      for (;;) {
        const msg = await queue.next(wait);
        if (msg === TIMED_OUT) throw new Timeout(`no answer within ${this._body.timeout} s`, { requestId: this.id });
        if (msg.type === MsgType.CHUNK) {
          yield msg.body.text;
        } else if (msg.type === MsgType.DONE) {
          ended = true;
          this.result = doneResult(msg.body);
          return;
        } else {
          ended = true;
          throw msg.error ?? errorFromWire(msg.body);
        }
      }
    } finally {
      if (this.client._forget(this.id) && !ended && this.client._sock) {
        await this.client._send(MsgType.CANCEL, { id: this.id }).catch(() => {}); // left early: cancel it
      }
    }
  }
}

/** A completion sent and not answered yet, as a reattach needs it: its REQUEST body; the start of the server it was
 * last sent to (its PONGs name it; null: sent again on a new connection, to whichever start answers there next); each
 * choice's text delivered; while it is streamed again after a reattach, how much of that text came again. */
class Track {
  constructor(body, server) {
    this.body = body;
    this.server = server;
    this.heard = false; // whether an answer of it came since it was last sent
    this._delivered = new Map(); // choice index -> its text delivered
    this._replay = new Map(); // choice index -> how much of its text delivered came again
  }

  /** Sent again, to `server`: every choice's text delivered is to come again first. */
  reattached(server) {
    this.server = server;
    this.heard = false;
    this._replay = new Map([...this._delivered].filter(([, text]) => text).map(([index]) => [index, 0]));
  }

  /** The part of `text` (the next chunk of choice `index`) not delivered already; throws ConnectionFailed if what
   * came again differs from what was delivered. */
  fresh(index, text) {
    const delivered = this._delivered.get(index) ?? "";
    const at = this._replay.get(index);
    if (at === undefined) {
      this._delivered.set(index, delivered + text);
      return text;
    }
    const again = delivered.slice(at, at + text.length);
    if (!text.startsWith(again)) {
      throw new ConnectionFailed(`request ${this.body.id}: after the server came back it ran again, and its text `
        + "differs from what was streamed before (a sampled request needs a seed to repeat); its stream ends here",
      { requestId: this.body.id });
    }
    if (at + again.length < delivered.length) this._replay.set(index, at + again.length);
    else this._replay.delete(index);
    const rest = text.slice(again.length);
    this._delivered.set(index, delivered + rest);
    return rest;
  }
}

function doneResult(body) {
  return {
    id: body.id,
    text: body.text,
    finishReason: body.finish_reason,
    usage: { promptTokens: body.usage.prompt_tokens, completionTokens: body.usage.completion_tokens },
    timings: body.timings,
    worker: body.worker ?? "",
  };
}

const TIMED_OUT = Symbol("timed out");

class Queue {
  constructor() {
    this._items = [];
    this._waiter = null;
  }

  push(item) {
    if (this._waiter) {
      const wake = this._waiter;
      this._waiter = null;
      wake(item);
    } else {
      this._items.push(item);
    }
  }

  next(waitMs = null) {
    if (this._items.length) return Promise.resolve(this._items.shift());
    return new Promise((resolve) => {
      let timer = null;
      this._waiter = (item) => { clearTimeout(timer); resolve(item); };
      if (waitMs != null) {
        timer = setTimeout(() => { this._waiter = null; resolve(TIMED_OUT); }, waitMs);
      }
    });
  }
}

function curveKeys(serverKey, secret) {
  if (serverKey == null && secret == null) return null;
  if (serverKey == null || secret == null) {
    throw new ConfigError("CURVE needs both curveServerKey (the server's public .key file) and curveSecret "
      + "(this client's .key_secret file)");
  }
  const own = readCertificate(secret);
  if (!own.secretKey) throw new ConfigError(`${secret} holds no secret key; pass the .key_secret file made by mpserve keygen`);
  return { serverKey: readCertificate(serverKey).publicKey, publicKey: own.publicKey, secretKey: own.secretKey };
}

/** A body without its nil fields: a left-out field means its default (nil is not accepted everywhere). */
function dropNulls(body) {
  return Object.fromEntries(Object.entries(body).filter(([, v]) => v !== null && v !== undefined));
}

function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms).unref());
}

/** A request's model and LoRA adapters, as the protocol's `adapters` ([name, scale] pairs, sorted by name): `model`
 * BASE:NAME applies NAME at scale 1; `adapters` is { name: scale } or a list of names. */
function adapterSelection(model, adapters) {
  const at = model === null ? -1 : model.indexOf(":");
  const base = at < 0 ? model : model.slice(0, at);
  const given = at < 0 ? [] : [[model.slice(at + 1), 1.0]];
  if (Array.isArray(adapters)) given.push(...adapters.map((a) => (Array.isArray(a) ? a : [a, 1.0])));
  else if (adapters) given.push(...Object.entries(adapters));
  const names = given.map(([name]) => name);
  const twice = names.find((name, i) => names.indexOf(name) !== i);
  if (twice !== undefined) {
    throw new BadRequest(`LoRA adapter '${twice}' is given twice; give each adapter once, with its scale`);
  }
  const bad = given.find(([, scale]) => typeof scale !== "number" || !Number.isFinite(scale));
  if (bad !== undefined) throw new BadRequest(`LoRA adapter '${bad[0]}': scale ${bad[1]} must be a number`);
  const chosen = given.filter(([, scale]) => scale !== 0);  // scale 0: off
  return [base, chosen.sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0))];
}
