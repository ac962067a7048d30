"""Fuzzing the HTTP gateway by hand, below any HTTP library: hostile and malformed requests over raw sockets
against a real ``mpserve start --http`` (the gateway its child process), with the tiny model.

    seeded generator ──▶ Case (bytes to send, how: at once, trickled, hung up on) ──▶ 16 asyncio connections
        families: valid · mutated JSON · wrong types and values · odd text (unicode, invalid UTF-8) · JSON
        oddities (depth, NaN, huge numbers) · HTTP oddities (methods, paths, framing, headers, pipelining) ·
        oversized · slow senders · hang-ups (before the answer, mid-stream)
    every answer parsed by h11 as a client would ──▶ OpenAI's error shape with a known code, or a success
        in the route's shape; no 5xx but 502/503/504; a connection closed without an answer only where the
        fuzzer itself hung up

Then: no traceback in the server's or the gateway's log, the broker holds no request, a normal request is
served, and the gateway's RSS, sampled all along and at the end, stays within ``RSS_GROWTH_LIMIT`` of what it
was after a warm-up (its open descriptors within ``FD_GROWTH_LIMIT``). The generator is seeded: a failure
reproduces with the same seed and count. ``MPSERVE_HTTP_FUZZ_REQUESTS`` sets the count (default 10,000);
``-s`` prints the outcomes by family, status and code, and the RSS.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
from conftest import ServerProcess
from helpers import MALLOC_ENV, free_port, http_up, rss_kib, wait_for

from mpserve import Client
from mpserve.errors import ErrorCode
from mpserve.gateway.http import limits

SEED = 20261201
HTTP_FUZZ_REQUESTS = int(os.environ.get("MPSERVE_HTTP_FUZZ_REQUESTS", "10000"))
WARMUP_REQUESTS = 600
CONCURRENCY = 16
READ_TIMEOUT_S = 1.0  # the gateway's header and body timeout: slow senders are cut off after it
CASE_TIMEOUT_S = 30.0  # a case that gets nothing for this long has hung
RSS_GROWTH_LIMIT = 0.10
FD_GROWTH_LIMIT = 8
GATEWAY_CODES = {"request_too_large", "request_timeout", "too_many_connections", "invalid_http", "not_found",
                 "method_not_allowed", "http_error", "invalid_host", "cross_origin", "unsupported_media_type"}
KNOWN_CODES = {code.value for code in ErrorCode} | GATEWAY_CODES
ALLOWED_5XX = {502, 503, 504}
API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/tokenize", "/detokenize")
ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "timeout_error",
                   "request_too_large", "rate_limit_error", "overloaded_error", "api_error"}
STREAM_ENDS = {"message_stop", "response.completed", "response.incomplete", "error"}  # the named-event streams
GET_PATHS = ("/health", "/metrics", "/v1/models", "/openapi.json", "/backend/monitor", "/console/state", "/")


# --- cases ---------------------------------------------------------------------------------------

@dataclass
class Case:
    family: str
    pieces: list[bytes]  # sent one after another
    pause_s: float = 0.0  # between pieces (a slow sender)
    method: str = "POST"  # what h11 is told the request was (a HEAD answer has no body)
    hang_up: str = ""  # "before": after sending, without reading; "mid": after the first bytes of the answer
    responses: int = 1  # pipelined requests: answers to read at most
    results: list[tuple[int, dict[str, str], bytes]] = field(default_factory=list)


def request(method: str, path: str, body: bytes = b"", headers: dict[str, str | None] | None = None,
            version: str = "HTTP/1.1") -> bytes:
    given = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
             **(headers or {})}
    head = f"{method} {path} {version}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in given.items() if v is not None)
    return head.encode("latin-1") + b"\r\n" + body


def post(path: str, body: bytes, **headers: str | None) -> bytes:
    return request("POST", path, body, headers)


def valid_body(rng: random.Random, path: str | None = None) -> tuple[str, dict[str, Any]]:
    path = path or rng.choice(API_PATHS)
    if path == "/tokenize":
        return path, {"content": rng.choice(["hi", "Hello world", ""]), "with_pieces": rng.random() < 0.5}
    if path == "/detokenize":
        return path, {"tokens": [rng.randrange(100) for _ in range(rng.randint(0, 5))]}
    body: dict[str, Any] = {"max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.8])}
    if path == "/v1/responses":
        body = {"max_output_tokens": body["max_tokens"], "temperature": body["temperature"],
                "input": rng.choice(["hi", [{"role": "user", "content": "What is 2+2?"}]])}
    elif path == "/v1/completions":
        body["prompt"] = rng.choice(["hi", "Once upon a time", "1 2 3", ""])
    else:
        body["messages"] = [{"role": "user", "content": rng.choice(["hi", "What is 2+2?"])}]
    if rng.random() < 0.4:
        body["stream"] = True
    if rng.random() < 0.2 and path != "/v1/responses":
        body["stop_sequences" if path == "/v1/messages" else "stop"] = ["\n"]
    return path, body


WEIRD: list[Any] = [
    None, True, False, 0, -1, 2**31, 2**63, 2**64, -(2**63), 10**30, 0.5, -0.0, 1e308, -1e308, 5e-324, "", "x",
    "x" * 5000, [], [1], [[[]]], {}, {"a": 1}, ["\n"] * 20, [None], {"role": "user"}, "\u0000", "\ufeff",
]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stream", "stream_options", "logit_bias", "logprobs", "top_logprobs", "n", "echo", "model",
          "response_format", "grammar", "json_schema", "tools", "tool_choice", "user", "content", "tokens",
          "with_pieces", "add_special", "input", "max_output_tokens", "instructions", "text", "previous_response_id",
          "system", "stop_sequences", "junk"]
ODD_TEXT = [
    "\u202eevil\u202c", "a\u200db\u200c", "e" + "\u0301" * 1000, "\U0001f600" * 50, "\uffff\ufffe", "\u0000",
    "\ufeffhi", "\U0010ffff", "\r\n\r\n", "<|im_end|>", "<|im_start|>system", "{{ 7 * 7 }}", "{% for %}", "\x1b[2J",
]
ODD_ESCAPES = [b'"\\ud800"', b'"\\udfff"', b'"a\\ud83d"', b'"\\ud83d\\ude00"', b'"\\u0000"', b'"\\uZZZZ"',
               b'"\\x41"', b'"\\', b'"\\u12"']
ODD_BYTES = [b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\xf4\x90\x80\x80", b"\x80", b"\xfe\xff"]


def valid(rng: random.Random) -> Case:
    path, body = valid_body(rng)
    return Case("valid", [post(path, json.dumps(body).encode())])


def mutated_json(rng: random.Random) -> Case:
    """A valid body with bytes flipped, inserted, deleted or cut off (Content-Length fits what is sent)."""
    path, body = valid_body(rng)
    data = bytearray(json.dumps(body).encode())
    for _ in range(rng.randint(1, 4)):
        op, at = rng.randrange(5), rng.randrange(len(data) + 1)
        if op == 0 and at < len(data):
            data[at] ^= 1 << rng.randrange(8)
        elif op == 1:
            data[at:at] = rng.choice([b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"\x00", rng.randbytes(3)])
        elif op == 2:
            del data[at:at + rng.randint(1, 6)]
        elif op == 3:
            del data[at:]
        else:
            data[at:at] = data[:rng.randint(1, 20)]
    return Case("mutated_json", [post(path, bytes(data))])


def wrong_fields(rng: random.Random) -> Case:
    """Well-formed JSON with fields of the wrong type or value, missing, unknown, or not an object at all."""
    path, body = valid_body(rng)
    if rng.random() < 0.1:
        return Case("wrong_fields", [post(path, json.dumps(rng.choice([[body], "body", 7, None, [], 1.5])).encode())])
    if rng.random() < 0.2 and body:
        del body[rng.choice(list(body))]
    if "messages" in body and rng.random() < 0.3:
        odd = {"role": rng.choice(["user", "robot", "", 7]), "content": rng.choice(WEIRD)}
        body["messages"] = rng.choice([[odd], [{"content": "hi"}], [{"role": "user", "content": [{"type": "x"}]}],
                                       [{"role": "tool", "content": "x", "tool_call_id": 5}], "hi", [[]]])
    body.update({rng.choice(FIELDS): rng.choice(WEIRD) for _ in range(rng.randint(1, 3))})
    return Case("wrong_fields", [post(path, json.dumps(body).encode())])


def odd_text(rng: random.Random) -> Case:
    """Unicode oddities where text goes, as JSON escapes or raw bytes, some of them not UTF-8 at all."""
    path, body = valid_body(rng, rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
    where = rng.choice(["content", "model"] if path == "/tokenize" else ["text", "text", "model", "stop", "user"])
    marker = "MARKER"
    if where == "text" and path == "/v1/chat/completions":
        body["messages"][0]["content"] = marker
    elif where == "text":
        body["prompt"] = marker
    elif where == "stop":
        body["stop"] = [marker]
    else:
        body[where] = marker
    data = json.dumps(body).encode()
    kind = rng.randrange(3)
    if kind == 0:
        text = json.dumps(rng.choice(ODD_TEXT), ensure_ascii=rng.random() < 0.5).encode()
    elif kind == 1:
        text = rng.choice(ODD_ESCAPES)
    else:
        text = b'"' + rng.choice(ODD_BYTES) + b'"'
    data = data.replace(b'"MARKER"', text)
    if rng.random() < 0.1:
        data = rng.choice([b"\xef\xbb\xbf" + data, data.decode("latin-1").encode("utf-16")])
    return Case("odd_text", [post(path, data)])


def json_oddities(rng: random.Random) -> Case:
    path = rng.choice(API_PATHS)
    depth = rng.choice([limits.MAX_JSON_DEPTH - 1, limits.MAX_JSON_DEPTH + 1, 1000, 100_000])
    data = rng.choice([
        b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth, b"[" * depth,
        b'{"prompt": "hi", "max_tokens": NaN}', b'{"prompt": "hi", "temperature": Infinity}',
        b'{"prompt": "hi", "temperature": -Infinity}', b'{"prompt": "hi", "max_tokens": 1e400}',
        b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", b'{"prompt": "hi", "seed": -0}',
        b'{"prompt": "hi", "prompt": ["a"], "max_tokens": 1}', b'{"prompt": "hi"} trailing', b"", b"   ", b"null",
        b"[]", b'"just a string"', b"{" + b'"k": 1, ' * 5000 + b'"prompt": "hi"}', b'{"' + b"k" * 100_000 + b'": 1}',
        b'{"prompt": [' + b"1," * 20000 + b'1], "max_tokens": 1}', b"{'prompt': 'hi'}", b'{"prompt": "hi",}',
        b'{"tokens": [1.5, 2]}', b'{"tokens": [' + b"9" * 30 + b"]}", b'{"logit_bias": {"1": 1e999}}',
    ])
    return Case("json_oddities", [post(path, data)])


METHODS = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "CONNECT", "FOO", "post", "G\x7fT", "POST "]
PATHS = ["/", "/v1", "/v1/completions/", "/v1/chat/completions?stream=true", "/../../etc/passwd", "/%2e%2e/x",
         "/v1/%00", "/%ff%fe", "/v1/completions#frag", "*", "http://evil/v1/completions", "/" + "a" * 8000,
         "/v1/models?" + "x=1&" * 500, "/backend/monitor?model=%ff", "/admin/models", "/console/state?x=%zz", ""]


def http_oddities(rng: random.Random) -> Case:
    path, body = valid_body(rng)
    data = json.dumps(body).encode()
    choice = rng.randrange(22)
    if choice == 0:
        method = rng.choice(METHODS)
        return Case("http_oddities", [request(method, rng.choice(API_PATHS + GET_PATHS), data)],
                    method="HEAD" if method == "HEAD" else "POST")
    if choice == 1:
        return Case("http_oddities", [request(rng.choice(["GET", "POST"]), rng.choice(PATHS), data)])
    if choice == 2:  # declared shorter than sent: the rest is a second, broken request
        return Case("http_oddities", [post(path, data, **{"Content-Length": str(len(data) // 2)}) + data],
                    responses=2)
    if choice == 3:
        return Case("http_oddities", [post(path, data, **{"Content-Length": rng.choice(["-1", "abc", "1e3", "0x10",
                                                                                          " ", "+5"])})])
    if choice == 4:
        return Case("http_oddities", [post(path, data, **{"Content-Length": f"{len(data)}, {len(data) + 1}"})])
    if choice == 5:  # chunked, well formed
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (data[:5], data[5:])) + b"0\r\n\r\n"
        return Case("http_oddities", [post(path, chunked, **{"Content-Length": None, "Transfer-Encoding": "chunked"})])
    if choice == 6:  # chunked, broken
        broken = rng.choice([b"zz\r\n" + data + b"\r\n0\r\n\r\n", b"%x\r\n%s0\r\n\r\n" % (len(data) + 9, data),
                             b"-1\r\n\r\n", b"%x;ext=\x00\r\n%s\r\n0\r\n\r\n" % (len(data), data)])
        return Case("http_oddities", [post(path, broken, **{"Content-Length": None, "Transfer-Encoding": "chunked"})])
    if choice == 7:
        return Case("http_oddities", [post(path, data, **{"Transfer-Encoding": rng.choice(["chunked", "gzip", "x"])})])
    if choice == 8:
        return Case("http_oddities", [request("POST", path, data, version=rng.choice(
            ["HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTP/1.1 extra", "HTTP/9.9", "http/1.1", "HTTP/1"]))])
    if choice == 9:
        return Case("http_oddities", [post(path, data, Host=None)])
    if choice == 10:
        return Case("http_oddities", [post(path, data, **{rng.choice(["Bad Header", "X:Y", "", "X\x00"]): "1"})])
    if choice == 11:
        return Case("http_oddities", [post(path, data, **{"X-Value": rng.choice(["a\x00b", "\x7f", "a\r b", "\xff"])})])
    if choice == 12:
        return Case("http_oddities", [post(path, data, **{f"X-H{i}": "v" * 50 for i in range(200)})])
    if choice == 13:  # headers over the gateway's limit, in one piece or in several
        big = post(path, data, **{"X-Big": "a" * 20_000})
        return Case("http_oddities", [big] if rng.random() < 0.5 else [big[:5000], big[5000:]])
    if choice == 14:
        return Case("http_oddities", [post(path, data, **{"Content-Type": rng.choice(
            ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", "\xff"])})])
    if choice == 15:
        return Case("http_oddities", [post(path, data, Expect="100-continue")])
    if choice == 16:
        return Case("http_oddities", [rng.choice([b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + rng.randbytes(40),
                                                  b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", rng.randbytes(64) + b"\r\n\r\n",
                                                  b"\r\n\r\n", b"GET\r\n\r\n", b"GET / HTTP/1.1\n\n"])])
    if choice == 17:  # pipelined
        n = rng.randint(2, 4)
        reqs = [request("GET", "/health") if rng.random() < 0.5 else post(*_dumped(valid_body(rng))) for _ in range(n)]
        return Case("http_oddities", [b"".join(reqs)], responses=n)
    if choice == 18:
        return Case("http_oddities", [post(path, data, Connection=rng.choice(["close", "keep-alive", "upgrade",
                                                                              "\x00"]))])
    if choice == 19:
        return Case("http_oddities", [post(path, data, Upgrade="websocket", Connection="Upgrade")])
    if choice == 20:
        return Case("http_oddities", [request("GET", rng.choice(GET_PATHS) + rng.choice(["", "?model=tiny", "?model=",
                                                                                          "?model=%00"]))],
                    method="GET")
    return Case("http_oddities", [request("POST", path, data, {"Authorization": rng.choice(
        ["Bearer x", "Basic Zm9v", "Bearer " + "k" * 5000, "\xff"])})])


def _dumped(path_body: tuple[str, dict[str, Any]]) -> tuple[str, bytes]:
    return path_body[0], json.dumps(path_body[1]).encode()


def oversized(rng: random.Random) -> Case:
    path = rng.choice(API_PATHS)
    declared = rng.choice([limits.MAX_BODY_BYTES + 1, 2**40, 10**30])
    return Case("oversized", [post(path, b"", **{"Content-Length": str(declared)}) + b'{"prompt": "'])


def slow(rng: random.Random) -> Case:
    """Slow senders: half a header, nothing at all, a body that trickles or stops short: 408 after the read
    timeout."""
    path, body = valid_body(rng)
    whole = post(path, json.dumps(body).encode())
    choice = rng.randrange(4)
    if choice == 0:
        return Case("slow", [whole[:rng.randint(1, whole.index(b"\r\n\r\n"))]])
    if choice == 1:
        return Case("slow", [b""])
    if choice == 2:
        cut = whole.index(b"\r\n\r\n") + 4
        return Case("slow", [whole[:cut], *[bytes([b]) for b in whole[cut:cut + 8]]], pause_s=READ_TIMEOUT_S / 4)
    return Case("slow", [whole[:-3]])


def hang_up(rng: random.Random) -> Case:
    """The client goes away: before its answer (queued or running), mid-stream, or halfway through sending."""
    path, body = valid_body(rng, rng.choice(["/v1/completions", "/v1/chat/completions"]))
    body["max_tokens"] = rng.choice([4, 32])
    if rng.random() < 0.6:
        body["stream"] = True
    whole = post(path, json.dumps(body).encode())
    choice = rng.randrange(3)
    if choice == 0:
        return Case("hang_up", [whole], hang_up="before")
    if choice == 1:
        return Case("hang_up", [whole], hang_up="mid")
    return Case("hang_up", [whole[:rng.randrange(1, len(whole))]], hang_up="before")


GENERATORS: list[tuple[float, Callable[[random.Random], Case]]] = [
    (0.12, valid), (0.18, mutated_json), (0.18, wrong_fields), (0.12, odd_text), (0.08, json_oddities),
    (0.22, http_oddities), (0.02, oversized), (0.005, slow), (0.075, hang_up),
]


def fuzz_cases(rng: random.Random, n: int) -> Iterator[Case]:
    weights = [w for w, _ in GENERATORS]
    for _ in range(n):
        yield rng.choices(GENERATORS, weights)[0][1](rng)


def test_the_generator_reaches_every_family_and_is_seeded() -> None:
    first = [c.pieces for c in fuzz_cases(random.Random(SEED), 500)]
    assert first == [c.pieces for c in fuzz_cases(random.Random(SEED), 500)]
    families = collections.Counter(c.family for c in fuzz_cases(random.Random(SEED), 3000))
    assert set(families) == {make.__name__ for _, make in GENERATORS}


# --- sending and checking ------------------------------------------------------------------------

class Outcomes:
    def __init__(self) -> None:
        self.statuses: collections.Counter[str] = collections.Counter()
        self.codes: collections.Counter[str] = collections.Counter()
        self.families: collections.Counter[str] = collections.Counter()
        self.problems: list[str] = []

    def problem(self, case: Case, what: str) -> None:
        self.problems.append(f"{case.family}: {what}; sent {b''.join(case.pieces)[:300]!r}")


async def run_case(port: int, case: Case, out: Outcomes) -> None:
    out.families[case.family] += 1
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    early = b""  # what the gateway sent while a slow sender paused: it stops sending then
    try:
        try:
            for i, piece in enumerate(case.pieces):
                if i and case.pause_s:
                    with contextlib.suppress(asyncio.TimeoutError):
                        early = await asyncio.wait_for(reader.read(65536), case.pause_s)
                    if early:
                        break
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            pass  # the gateway answered and closed before it took everything: its answer is still read
        if case.hang_up:
            if case.hang_up == "mid":
                await asyncio.wait_for(reader.read(1), CASE_TIMEOUT_S)
            out.statuses["hung up"] += 1
            writer.transport.abort()
            return
        await asyncio.wait_for(read_answers(reader, case, early), CASE_TIMEOUT_S)
    except asyncio.TimeoutError:
        out.problem(case, f"nothing more within {CASE_TIMEOUT_S} s after {len(case.results)} answer(s)")
    except (h11.RemoteProtocolError, ConnectionError) as exc:
        out.problem(case, f"a broken answer: {exc!r}")
    finally:
        writer.close()
    if not case.results and not case.hang_up:
        out.problem(case, "the connection closed without an answer")
    for status, headers, body in case.results:
        check_answer(case, status, headers, body, out)


async def read_answers(reader: asyncio.StreamReader, case: Case, early: bytes) -> None:
    """Parse what the gateway sends with h11, as a client: up to ``case.responses`` answers, or until it
    closes the connection."""
    conn = h11.Connection(h11.CLIENT)
    if early:
        conn.receive_data(early)
    for _ in range(case.responses):
        conn.send(h11.Request(method=case.method, target="/", headers=[("Host", "x")]))
        conn.send(h11.EndOfMessage())
        status, headers, body = 0, {}, bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode().lower(): v.decode("latin-1") for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                case.results.append((status, headers, bytes(body)))
                break
            elif isinstance(event, h11.ConnectionClosed):
                return
        if conn.their_state is not h11.DONE:
            return  # Connection: close
        conn.start_next_cycle()


def check_answer(case: Case, status: int, headers: dict[str, str], body: bytes, out: Outcomes) -> None:
    out.statuses[str(status)] += 1
    kind = headers.get("content-type", "").split(";")[0]
    if case.family == "valid" and status != 200:  # normal requests are served all along
        out.problem(case, f"a valid request got {status}: {body[:200]!r}")
    if case.method == "HEAD":  # an answer without its body
        if status >= 500:
            out.problem(case, f"a {status} to HEAD")
        return
    if status >= 400:
        try:
            answer = json.loads(body)
            error = answer["error"]
        except (ValueError, KeyError, TypeError):
            return out.problem(case, f"{status} not in OpenAI's error shape: {kind} {body[:200]!r}")
        if answer.get("type") == "error":  # /v1/messages: Anthropic's shape
            out.codes[f"anthropic {error.get('type')}"] += 1
            if kind != "application/json" or set(error) != {"type", "message"} or error["type"] not in ANTHROPIC_TYPES:
                out.problem(case, f"{status} not in Anthropic's error shape: {kind} {error}")
            if status >= 500 and status not in ALLOWED_5XX:
                out.problem(case, f"an undocumented {status}: {error}")
            return
        out.codes[error["code"]] += 1
        if kind != "application/json" or set(error) != {"message", "type", "param", "code"}:
            out.problem(case, f"{status} not in OpenAI's error shape: {kind} {error}")
        if error["code"] not in KNOWN_CODES:
            out.problem(case, f"{status} with an unknown code: {error}")
        if status >= 500 and status not in ALLOWED_5XX:
            out.problem(case, f"an undocumented {status}: {error}")
        return
    if status in (307, 308):
        if "location" not in headers:
            out.problem(case, f"a {status} without Location")
        return
    if status != 200:
        return out.problem(case, f"an unexpected status {status}: {body[:200]!r}")
    if kind not in ("application/json", "text/event-stream"):
        return  # the monitoring routes' text (metrics, the console page)
    if kind == "text/event-stream":
        events = [e.split("\n")[-1] for e in body.decode().split("\n\n") if e]  # named ones: event: then data:
        if not events or not all(e.startswith("data: ") for e in events):
            return out.problem(case, f"a malformed event stream: {body[:300]!r}")
        last = events[-1].removeprefix("data: ")
        if last != "[DONE]" and "error" not in json.loads(last) and json.loads(last).get("type") not in STREAM_ENDS:
            out.problem(case, f"an event stream that ends with neither [DONE] nor an error: {last[:200]}")
        for e in events[:-1]:
            json.loads(e.removeprefix("data: "))
        out.codes["ok (stream)"] += 1
        return
    json.loads(body)
    out.codes["ok"] += 1


async def send_all(port: int, cases: Iterator[Case], out: Outcomes) -> None:
    async def lane() -> None:
        for case in cases:
            await run_case(port, case, out)

    await asyncio.gather(*(lane() for _ in range(CONCURRENCY)))


# --- the test ------------------------------------------------------------------------------------

def gateway_pid(server: ServerProcess) -> int:
    """The gateway: the server's child process running ``mpserve gateway``."""
    for task in Path(f"/proc/{server.proc.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            if b"gateway" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return int(pid)
    raise AssertionError("no gateway process")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def quiesce(server: ServerProcess, url: str) -> None:
    """The broker holds no request (hung-up ones are cancelled), and a normal request is served."""
    with Client(server.address, timeout=30) as client:
        wait_for(lambda: all(m.queued == m.running == 0 for m in client.stats().models.values()), 30,
                 "the broker holds no request")
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "after the storm", "max_tokens": 4,
                                                        "temperature": 0}, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4, answer.text


@pytest.mark.timeout(300)
def test_hostile_http_requests_get_well_formed_answers_and_leak_nothing(start_server) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # test_fuzz's allocator settings (the gateway inherits them): RSS then measures what the gateway holds on
    # to, not where glibc's thresholds drifted after a large body
    server = start_server("--http", f"127.0.0.1:{port}", "--n-ctx", "64", "--instances", "1", "--threads", "1",
                          env={**MALLOC_ENV, "MPSERVE_HTTP_READ_TIMEOUT": str(READ_TIMEOUT_S)}).wait_ready()
    wait_for(lambda: http_up(url), 30, "the gateway answers /health")
    gateway = gateway_pid(server)
    rng = random.Random(SEED)
    warm = Outcomes()
    asyncio.run(send_all(port, fuzz_cases(rng, WARMUP_REQUESTS), warm))
    quiesce(server, url)
    rss_before, fds_before = rss_kib(gateway), open_fds(gateway)
    peak, stop = [rss_before], threading.Event()

    def sample() -> None:
        while not stop.wait(0.1):
            peak.append(rss_kib(gateway))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = Outcomes()
    started = time.monotonic()
    try:
        asyncio.run(send_all(port, fuzz_cases(rng, HTTP_FUZZ_REQUESTS), out))
    finally:
        stop.set()
        sampler.join()
    fuzz_s = time.monotonic() - started
    assert server.proc.poll() is None, "\n".join(server.log)
    quiesce(server, url)
    rss_after, fds_after = rss_kib(gateway), open_fds(gateway)
    growth = (rss_after - rss_before) / rss_before
    print(f"\nhttp fuzz: {WARMUP_REQUESTS} warm-up + {HTTP_FUZZ_REQUESTS} requests (seed {SEED}) in {fuzz_s:.1f} s, "
          f"{CONCURRENCY} connections at once; families {dict(out.families)}; statuses {dict(out.statuses)}; "
          f"codes {dict(out.codes)}; gateway RSS {rss_before / 1024:.1f} MiB after warm-up, at most "
          f"{max(peak) / 1024:.1f} MiB during the fuzz, {rss_after / 1024:.1f} MiB at the end ({growth:+.1%}); "
          f"open descriptors {fds_before} -> {fds_after}")
    assert not warm.problems + out.problems, "\n".join((warm.problems + out.problems)[:20])
    assert not server.tracebacks(), "\n".join(server.log)
    assert growth <= RSS_GROWTH_LIMIT and max(peak) <= rss_before * (1 + RSS_GROWTH_LIMIT)
    assert fds_after - fds_before <= FD_GROWTH_LIMIT
    assert out.codes["ok"] and out.codes["ok (stream)"] and out.codes["bad_request"] and out.codes["invalid_http"]
    assert out.codes["request_timeout"] and out.codes["request_too_large"] and out.statuses["hung up"]

