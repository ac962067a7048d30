// mpserve console: polls /console/state once a second and draws it; the playground streams from /v1.
// Plain DOM, no library. Every value from the server is set as text (textContent), never parsed as HTML.
"use strict";

const KEY_STORAGE = "mpserve-api-key";
const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000; // a tab in the background asks less often
const $ = (id) => document.getElementById(id);

let apiKey = sessionStorage.getItem(KEY_STORAGE) || "";
let pollTimer = null;
let polling = false; // one poll at a time, whatever wakes it (the timer, a key, the tab coming back)
let shownModels = "";

// --- small helpers -------------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra);
  if (apiKey) headers.Authorization = "Bearer " + apiKey;
  return headers;
}

function duration(s) {
  if (s === null || s === undefined) return "–";
  if (s < 60) return s.toFixed(s < 10 ? 1 : 0) + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + String(Math.floor(s % 60)).padStart(2, "0") + " s";
  return Math.floor(s / 3600) + " h " + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + " m";
}

function bytes(n) {
  const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [unit, scale] of units) if (n >= scale) return (n / scale).toFixed(1) + " " + unit;
  return n + " B";
}

function ms(value) {
  return value < 1000 ? Math.round(value) + " ms" : (value / 1000).toFixed(2) + " s";
}

function rate(value) {
  return value === null || value === undefined ? "–" : value.toFixed(1);
}

// --- the API key ---------------------------------------------------------------------------------

function askForKey(refused) {
  $("main").hidden = true; // nothing from an earlier key stays on screen
  $("slots").tBodies[0].replaceChildren();
  for (const id of ["models", "outcomes", "gpus", "pools", "play-out", "play-timings"]) $(id).replaceChildren();
  $("key-form").hidden = false;
  $("key-note").textContent = refused
    ? "That key was refused. Kept in this browser tab only (session storage)."
    : "Kept in this browser tab only (session storage), sent as a Bearer token.";
  $("key-button").hidden = false;
  setStatus("down", "key needed");
  $("key-input").focus();
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  apiKey = $("key-input").value.trim();
  sessionStorage.setItem(KEY_STORAGE, apiKey);
  $("key-input").value = "";
  $("key-form").hidden = true;
  poll();
});

$("key-button").addEventListener("click", () => {
  apiKey = "";
  sessionStorage.removeItem(KEY_STORAGE);
  askForKey(false);
});

// --- polling -------------------------------------------------------------------------------------

async function poll() {
  if (polling) return;
  polling = true;
  clearTimeout(pollTimer);
  try {
    const response = await fetch("/console/state", { headers: authHeaders(), cache: "no-store" });
    if (response.status === 401) {
      askForKey(Boolean(apiKey));
      return;
    }
    if (!response.ok) throw new Error("the gateway answered HTTP " + response.status);
    render(await response.json());
    $("banner").hidden = true;
    $("main").classList.remove("stale");
  } catch (error) {
    setStatus("down", "gateway unreachable");
    $("main").classList.add("stale"); // what is shown is the last state seen
    showBanner("Cannot reach the gateway: " + error.message);
  } finally {
    polling = false;
  }
  if (!$("key-form").hidden) return; // until a key is given
  pollTimer = setTimeout(poll, document.hidden ? HIDDEN_POLL_MS : POLL_MS);
}

function setStatus(kind, text) {
  const pill = $("status");
  pill.className = "pill " + kind;
  pill.textContent = text;
}

function showBanner(text) {
  $("banner").textContent = text;
  $("banner").hidden = false;
}

// --- drawing the state ---------------------------------------------------------------------------

function render(state) {
  const server = state.server;
  $("server").textContent = server.name + " · " + server.address;
  if (!server.reachable) {
    setStatus("down", "server down");
    showBanner("No mpserve server answers at " + server.address + ".");
  } else if (!server.accepting) {
    setStatus("warn", "stopping");
  } else {
    setStatus("ok", "serving");
  }
  $("main").hidden = false;
  renderSlots(state.slots, server.local);
  renderPools(state.pools);
  renderModels(state.models, state.series_step_s, state.downloads || [], state.store);
  renderOutcomes(state.outcomes);
  renderGpus(state.gpus, state.gpu_error, server.local);
  updateModelChoice(state.models);
}

function renderSlots(slots, local) {
  const cell = (label, value, cls) => el("td", { "data-label": label, class: cls }, value);
  const rows = slots.map((s) => el("tr", { class: s.state, "data-state": s.state, "data-index": s.index },
    cell("slot", s.index),
    cell("instance", "w" + s.worker + (s.slot ? "·" + s.slot : ""), null),
    cell("state", el("span", { class: "state " + s.state }, s.state)),
    cell("model", s.model),
    cell("device", s.device),
    cell("request", s.request || "–", "request"),
    cell("adapters", s.adapters || "–", "adapters"),
    cell("tokens", s.tokens ?? "–", "num"),  // null: another tenant's request
    cell("tok/s", rate(s.tokens_per_s), "num"),
    cell("in state", duration(s.state_s), "num"),
    cell("served", s.served, "num")));
  $("slots").tBodies[0].replaceChildren(...rows);
  $("slots").hidden = slots.length === 0;
  $("no-slots").hidden = slots.length > 0;
  if (!local) $("no-slots").textContent = "No slot table: the server is not on this host (or not running).";
}

function renderPools(pools) {
  if (!pools.length) {
    $("pools").replaceChildren();
    return;
  }
  const head = el("tr", null, ...["host", "worker", "model", "device", "running"].map((h) => el("th", null, h)));
  const rows = pools.map((p) => el("tr", { class: p.running ? "busy" : "idle", "data-host": p.host },
    el("td", null, el("span", { class: "host" }, p.host || "server")),
    el("td", null, p.worker), el("td", null, p.model), el("td", null, p.device),
    el("td", { class: "num" }, p.running + " / " + p.capacity)));
  $("pools").replaceChildren(el("h2", { class: "small" }, "Workers the broker knows"),
    el("table", null, el("thead", null, head), el("tbody", null, ...rows)));
}

function figure(value, label) {
  return el("div", { class: "figure" }, el("b", null, value), el("span", null, label));
}

// The host store's tiers are the host's (every model and server on it): shown once, above the models; each
// model shows only its own instances' counts.
function hostStoreLine(store) {
  if (!store) return null;
  const h = store.host;
  const disk = h.disk_capacity ? ", disk " + bytes(h.disk_bytes) + " of " + bytes(h.disk_capacity) : "";
  return el("p", { class: "muted", "data-store-host": "" }, "Host store (host-wide: every model and server on " +
    "this host): RAM " + bytes(h.bytes) + " of " + bytes(h.capacity) + disk);
}

function storeLine(counts) {
  if (!counts) return null;
  return el("div", { class: "spark-caption", "data-store": "" }, "host store, this model: " + counts.hits +
    " hits, " + counts.misses + " misses, " + counts.evictions + " evictions, " + counts.skipped + " skipped");
}

function renderDownloads(downloads) {
  return downloads.map((d) => el("div", { class: "model download", "data-download": d.file },
    el("div", { class: "model-name" }, "downloading " + d.file),
    el("div", { class: "figures" },
      figure(Math.floor(100 * d.done_bytes / Math.max(d.total_bytes, 1)) + "%", "done"),
      figure(bytes(d.done_bytes) + " / " + bytes(d.total_bytes), "size"),
      figure(bytes(d.bytes_per_s) + "/s", "speed"),
      figure(duration(d.left_s), "time left"))));
}

function renderModels(models, stepS, downloads, store) {
  if (!models.length) {
    $("models").replaceChildren(...renderDownloads(downloads), el("p", { class: "muted" },
      downloads.length ? "The server starts once its models are downloaded." : "No models (the server does not answer)."));
    return;
  }
  const host = hostStoreLine(store);
  $("models").replaceChildren(...renderDownloads(downloads), ...(host ? [host] : []), ...models.map((m) => {
    const series = m.tokens_per_s;
    const known = series.filter((v) => v !== null);
    const now = known.length ? known[known.length - 1] : null;
    return el("div", { class: "model", "data-model": m.name },
      el("div", { class: "model-name" }, m.name),
      m.failed ? el("div", { class: "error" }, "cannot load: " + m.failed) : null,
      el("div", { class: "figures" },
        figure(m.queued, "queued"),
        figure(m.queued ? duration(m.oldest_wait_s) : "–", "oldest wait"),
        figure(m.running + " / " + (m.running + m.free_slots), "slots busy"),
        figure(m.instances, "instances"),
        figure(rate(now), "tokens/s")),
      sparkline(series, series.length * stepS),
      el("div", { class: "spark-caption" }, "tokens/s over the last " + duration(series.length * stepS) +
        (known.length ? ", peak " + Math.max(...known).toFixed(0) : "")),
      storeLine(store ? store.models[m.name] : null));
  }));
}

function sparkline(series, spanS) {
  const svgNS = "http://www.w3.org/2000/svg";
  const svg = document.createElementNS(svgNS, "svg");
  const peak = Math.max(1, ...series.filter((v) => v !== null));
  const width = series.length - 1 || 1;
  svg.setAttribute("viewBox", "0 0 " + width + " 30");
  svg.setAttribute("preserveAspectRatio", "none");
  svg.setAttribute("class", "spark");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", "tokens per second over the last " + duration(spanS) + ", peak " + peak.toFixed(0));
  const base = document.createElementNS(svgNS, "line");
  for (const [k, v] of [["x1", 0], ["y1", 29.5], ["x2", width], ["y2", 29.5]]) base.setAttribute(k, v);
  svg.append(base);
  let points = [];
  const flush = () => {
    if (points.length > 1) {
      const line = document.createElementNS(svgNS, "polyline");
      line.setAttribute("points", points.join(" "));
      svg.append(line);
    }
    points = [];
  };
  series.forEach((v, i) => {
    if (v === null) flush();
    else points.push(i + "," + (29 - (v / peak) * 27).toFixed(2));
  });
  flush();
  const title = document.createElementNS(svgNS, "title");
  title.textContent = "tokens/s, last " + duration(spanS) + " (peak " + peak.toFixed(0) + ")";
  svg.append(title);
  return svg;
}

function renderOutcomes(outcomes) {
  $("outcome-window").textContent = "HTTP, last " + duration(outcomes.window_s);
  const codes = Object.entries(outcomes.codes);
  if (!codes.length) {
    $("outcomes").replaceChildren(el("p", { class: "muted" }, "No requests through this gateway yet."));
    return;
  }
  $("outcomes").replaceChildren(el("div", { class: "chips" }, ...codes.map(([code, n]) =>
    el("span", { class: "chip " + (code === "ok" ? "ok" : "err"), "data-code": code }, code, el("b", null, n)))));
}

function renderGpus(gpus, error, local) {
  if (!local) {
    $("gpus").replaceChildren(el("p", { class: "muted" }, "Shown for a server on this host only."));
    return;
  }
  if (error) {
    $("gpus").replaceChildren(el("div", { class: "error" }, error));
    return;
  }
  if (!gpus.length) {
    $("gpus").replaceChildren(el("p", { class: "muted" }, "No GPU found: instances run on the CPU."));
    return;
  }
  $("gpus").replaceChildren(...gpus.map((g) => {
    const used = g.memory_total - g.memory_free;
    const p = g.permits;
    const who = (entry) => "pid " + entry.pid + (entry.slots.length ? " (slot " + entry.slots.join(", ") + ")" : "");
    return el("div", { class: "gpu", "data-gpu": g.index },
      el("div", { class: "model-name" }, "gpu" + g.index + " · " + g.name + (g.simulated ? " (simulated)" : "")),
      el("div", { class: "bar", title: "memory used" },
        el("div", { style: "width:" + (g.memory_total ? (100 * used / g.memory_total).toFixed(1) : 0) + "%" })),
      el("div", { class: "muted small" }, bytes(used) + " used, " + bytes(g.memory_free) + " free of " +
        bytes(g.memory_total) + " · slots here: " + (g.slots.length ? g.slots.join(", ") : "none")),
      el("div", { class: "figures" },
        figure(p ? p.held.length + " / " + (p.capacity === null ? "∞" : p.capacity) : "–", "permits held"),
        figure(p ? p.waiting.length : "–", "waiting")),
      p && (p.held.length || p.waiting.length)
        ? el("ul", { class: "holders" },
          ...p.held.map((h) => el("li", null, "held by " + who(h) + " for " + duration(h.held_s))),
          ...p.waiting.map((w) => el("li", null, "waited on by " + who(w) + " for " + duration(w.waiting_s))))
        : el("div", { class: "muted small" }, p ? "no holder" : "no permits in use (shared mode)"));
  }));
}

function updateModelChoice(models) {
  const names = models.map((m) => m.name);
  if (names.join("\n") === shownModels) return;
  shownModels = names.join("\n");
  const select = $("play-model");
  const chosen = select.value;
  select.replaceChildren(...names.map((n) => el("option", { value: n, selected: n === chosen }, n)));
}

// --- the playground ------------------------------------------------------------------------------

class RequestFailed extends Error {
  constructor(status, error) {
    super((error && error.message) || "HTTP " + status);
    this.status = status;
    this.code = (error && error.code) || "http_" + status;
  }
}

let controller = null;

$("play").addEventListener("submit", async (event) => {
  event.preventDefault();
  const kind = $("play").elements.kind.value;
  const prompt = $("play-prompt").value;
  const body = {
    model: $("play-model").value || undefined,
    max_tokens: Number($("play-max").value),
    temperature: Number($("play-temp").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (kind === "chat") body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;

  const out = $("play-out");
  out.textContent = "";
  out.dataset.chunks = "0";
  out.dataset.done = "false";
  $("play-error").hidden = true;
  $("play-send").disabled = true;
  $("play-stop").disabled = false;
  controller = new AbortController();
  const run = { started: performance.now(), first: null, tokens: null, server: null, finish: null };
  showTimings(run, "waiting");
  try {
    const response = await fetch(kind === "chat" ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: authHeaders({ "Content-Type": "application/json" }),
      body: JSON.stringify(body), signal: controller.signal,
    });
    if (!response.ok) {
      const answer = await response.json().catch(() => null);
      throw new RequestFailed(response.status, answer && answer.error);
    }
    for await (const data of events(response.body)) {
      if (data.error) throw new RequestFailed(response.status, data.error);
      if (data.usage) {
        run.tokens = data.usage.completion_tokens;
        run.server = data.timings || null;
      }
      for (const choice of data.choices || []) {
        const text = kind === "chat" ? (choice.delta && choice.delta.content) || "" : choice.text || "";
        if (text) {
          if (run.first === null) run.first = performance.now();
          out.textContent += text;
          out.dataset.chunks = String(Number(out.dataset.chunks) + 1);
          out.scrollTop = out.scrollHeight;
        }
        if (choice.finish_reason) run.finish = choice.finish_reason;
      }
      showTimings(run, "streaming");
    }
    showTimings(run, "done");
  } catch (error) {
    if (error.name === "AbortError") {
      showTimings(run, "stopped");
    } else {
      showTimings(run, "failed");
      $("play-error").textContent = (error.code || "error") + (error.status ? " (HTTP " + error.status + ")" : "") +
        ": " + error.message;
      $("play-error").hidden = false;
    }
  } finally {
    out.dataset.done = "true";
    $("play-send").disabled = false;
    $("play-stop").disabled = true;
    controller = null;
  }
});

$("play-stop").addEventListener("click", () => controller && controller.abort());

// The data of each server-sent event, parsed as JSON ("[DONE]" ends the stream).
async function* events(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffered += value;
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const event = buffered.slice(0, end);
      buffered = buffered.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function showTimings(run, phase) {
  const now = performance.now();
  const parts = [phase];
  if (run.first !== null) parts.push("first text " + ms(run.first - run.started));
  parts.push((phase === "done" ? "total " : "elapsed ") + ms(now - run.started));
  if (run.tokens !== null) {
    parts.push(run.tokens + " tokens");
    const s = run.server;
    const generating = s ? s.generate_ms : run.first !== null ? now - run.first : 0;
    if (generating > 0 && run.tokens > 1) parts.push(((run.tokens - 1) / (generating / 1000)).toFixed(1) + " tok/s");
  }
  if (run.server) {
    const s = run.server;
    parts.push("server: queue " + ms(s.queue_ms) + ", prompt " + ms(s.prompt_ms) + ", generate " + ms(s.generate_ms) +
      ", " + s.cached_tokens + " prompt tokens cached" + (s.attempts > 1 ? ", " + s.attempts + " attempts" : ""));
  }
  if (run.finish) parts.push("finish: " + run.finish);
  $("play-timings").textContent = parts.join(" · ");
}

document.addEventListener("visibilitychange", () => { if (!document.hidden && $("key-form").hidden) poll(); });
poll();
