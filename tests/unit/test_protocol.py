"""The wire: round trips, and refusal of anything malformed with a named problem."""

from __future__ import annotations

import random
import re
from typing import Any

import msgpack
import pytest

from mpserve.errors import BadRequest, MpserveError, ProtocolError
from mpserve.wire import messages
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import MAX_BLOCKS, PREFIX_BLOCK, block_hashes

pytestmark = pytest.mark.timeout(10)


def test_every_message_type_round_trips() -> None:
    req = wire.Request("r1", "hello", "tiny", wire.GenerateParams(max_tokens=5, seed=3, stop=("x",)), True, 2.5)
    messages = [
        req, wire.Cancel("r1"), wire.Ping(7), wire.Pong(7, ("a", "b")), wire.Chunk("r1", "he"),
        wire.Done("r1", "hey", "length", wire.Usage(2, 3), wire.Timings(1.0, 2.0, 3.0, 1), "w0"),
        wire.Error("r1", "busy", "full", 1.5), wire.Error(None, "protocol", "bad"),
        wire.Assign("t1", req, 0.5, 1), wire.Stop("bye"),
    ]
    for msg in messages:
        assert wire.decode(wire.encode(msg)) == msg


def test_worker_messages_carry_a_ticket_frame() -> None:
    frames = wire.encode_from_worker(wire.Ready("w1", "tiny", -1, 1, 123), "")
    assert len(frames) == 4 and frames[2] == b""
    assert wire.decode_body(wire.parse_header(frames, 4), frames[3]) == wire.Ready("w1", "tiny", -1, 1, 123)


def test_a_chunk_may_carry_its_token_ids_and_an_assign_the_tokens_to_resume_from() -> None:
    tokens = [1, 0, 31999, 2**31 - 1]
    frames = wire.encode_from_worker(wire.Chunk("r1", "text"), "t1", wire.token_frame(tokens))
    assert len(frames) == 5 and wire.frame_tokens(frames[4]) == tokens
    assign = wire.Assign("t1", wire.Request("r1", "hi"), 1.0, 2, report_tokens=True,
                         generated=wire.token_frame(tokens))
    decoded = wire.decode(wire.encode(assign))
    assert decoded == assign and wire.frame_tokens(decoded.generated) == tokens
    old = wire.decode(wire.encode(wire.Assign("t1", wire.Request("r1", "hi"), 1.0, 1)))  # what an old broker sends
    assert not old.report_tokens and old.generated == b""
    with pytest.raises(ProtocolError, match="int32"):
        wire.decode_as(wire.Assign, wire.pack({**msgpack.unpackb(wire.pack(assign)), "generated": b"\x00" * 5}))


def test_a_done_may_carry_the_prompt_caches_changes_in_a_cache_frame() -> None:
    hashes = block_hashes("x" * 3 * PREFIX_BLOCK)
    changes = wire.CacheChanges(((7, wire.pack_hashes(hashes)),), dropped=(3, 4))
    done = wire.Done("r1", "hey", "length", wire.Usage(2, 3), wire.Timings())
    frames = wire.encode_from_worker(done, "t1", wire.pack(changes))
    assert len(frames) == 5 and wire.decode_body(wire.parse_header(frames, 5), frames[3]) == done
    back = wire.frame_cache(frames[4])
    assert back == changes and wire.unpack_hashes(back.added[0][1]) == hashes and len(hashes) == 3
    assert not wire.CacheChanges() and wire.frame_cache(wire.pack(wire.CacheChanges())) == wire.CacheChanges()


@pytest.mark.parametrize("body, problem", [
    ({"added": [[1, b"\x00" * 7]]}, "a CACHE entry"),  # not whole uint64s
    ({"added": [[1, b"\x00" * 8 * (MAX_BLOCKS + 1)]]}, "'added' must hold at most"),  # more blocks than a text has
    ({"added": [[-1, b""]]}, "'added' must be between 0"), ({"added": [["1", b""]]}, "'added' must be an integer"),
    ({"added": [[True, b""]]}, "'added' must be an integer"), ({"added": [[1]]}, "'added' must hold 2 items"),
    ({"added": "x"}, "'added' must be a list"), ({"dropped": [1, 2**63]}, "'dropped' must be between 0"),
    ({"dropped": list(range(5000))}, "'dropped' must hold at most 4096"),  # longer than any frame may hold
])
def test_a_malformed_cache_frame_is_refused(body: dict[str, object], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        wire.frame_cache(msgpack.packb(body, use_bin_type=True))


@pytest.mark.parametrize("n", [1, 15, 16, 300])  # the three sizes of a msgpack array's header
def test_a_steps_messages_travel_as_one_message_and_its_chunks_as_one_per_client(n: int) -> None:
    done = wire.Done("r0", "é", "stop", wire.Usage(1, 1), wire.Timings(0, 0, 0))
    step = [(wire.MsgType.CHUNK, f"t{i}", wire.pack(wire.Chunk(f"r{i}", "é" * i)),
             wire.token_frame([i]) if i % 2 else None) for i in range(n)]
    step.append((wire.MsgType.DONE, "t0", wire.pack(done), wire.pack(wire.CacheChanges(dropped=(3,)))))
    frames = wire.encode_step(step)
    assert wire.parse_header(frames, 4) is wire.MsgType.STEP and frames[2] == b""
    entries = wire.step_entries(frames[3])
    assert entries == step
    bodies = [body for _, _, body, _ in step[:-1]]
    to_client = [wire.VERSION, wire.TYPE_FRAMES[wire.MsgType.CHUNKS], wire.splice_array(bodies)]
    assert wire.decode(to_client) == wire.Chunks(tuple(wire.Chunk(f"r{i}", "é" * i) for i in range(n)))
    assert wire.decode_body(entries[-1][0], entries[-1][2]) == done


@pytest.mark.parametrize("n", [1, 2, 20])
def test_assigns_for_one_worker_travel_as_one_message(n: int) -> None:
    assigns = [wire.Assign(f"t{i}", wire.Request(f"r{i}", "hi" * i), 0.5, 1, slot=i) for i in range(n)]
    frames = wire.encode_assigns([wire.pack(a) for a in assigns])
    got = wire.decode(frames)
    assert got == (assigns[0] if n == 1 else wire.Assigns(tuple(assigns)))


@pytest.mark.parametrize("batch, problem", [
    (msgpack.packb({"a": 1}), "must be a msgpack array"),
    (msgpack.packb([[0x10, "t1", b"x"]], use_bin_type=True), "a STEP entry"),
    (msgpack.packb([[0x10, 1, b"x", None]], use_bin_type=True), "a STEP entry"),
    (msgpack.packb([[0x10, "t1", "not bytes", None]], use_bin_type=True), "a STEP entry"),
    (msgpack.packb([[True, "t1", b"x", None]], use_bin_type=True), "a STEP entry"),
    (msgpack.packb([[0x20, "t1", b"x", None]], use_bin_type=True), "not type 32"),  # a READY
    (msgpack.packb([[0x7f, "t1", b"x", None]], use_bin_type=True), "not type 127"),
])
def test_a_malformed_step_is_refused(batch: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        wire.step_entries(batch)
    with pytest.raises(ProtocolError):
        wire.decode([wire.VERSION, wire.TYPE_FRAMES[wire.MsgType.CHUNKS], msgpack.packb([1, 2])])
    with pytest.raises(ProtocolError):
        wire.decode([wire.VERSION, wire.TYPE_FRAMES[wire.MsgType.ASSIGNS], msgpack.packb([{"ticket": 1}])])


@pytest.mark.parametrize("frames, problem", [
    ([wire.VERSION, b"\x01"], "expected 3 frames"),
    ([b"MPS9", b"\x01", b"\x80"], "unsupported protocol version"),
    ([wire.VERSION, b"\x7f", b"\x80"], "unknown message type"),
    ([wire.VERSION, b"\x01\x01", b"\x80"], "one byte"),
    ([wire.VERSION, b"\x01", b"\xc1"], "not valid msgpack"),
    ([wire.VERSION, b"\x01", msgpack.packb([1, 2])], "must be a msgpack map"),
    ([wire.VERSION, b"\x01", msgpack.packb({"prompt": "x"})], "missing field 'id'"),
    ([wire.VERSION, b"\x01", msgpack.packb({"id": 5, "prompt": "x"})], "'id' must be a string"),
    ([wire.VERSION, b"\x11", msgpack.packb({"id": "r", "text": "", "finish_reason": "stop", "usage": {},
                                            "timings": {"queue_ms": "x"}})], "field 'queue_ms' must be a number"),
])
def test_malformed_messages_raise_protocol_errors(frames: list[bytes], problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        wire.decode(frames)


@pytest.mark.parametrize("params, problem", [
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 1 << 40}, "max_tokens"), ({"max_tokens": True}, "boolean"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": float("nan")}, "finite"),
    ({"top_p": 2}, "top_p"), ({"seed": -3}, "seed"), ({"stop": "x"}, "stop"),
    ({"stop": [""]}, "stop"), ({"stop": ["x"] * 100}, "stop"), ({"stop": [3]}, "stop"),
    ({"bogus": 1}, "unknown parameter"),
])
def test_bad_parameters_are_bad_requests(params: dict[str, object], problem: str) -> None:
    body = msgpack.packb({"id": "a", "prompt": "p", "params": params})
    with pytest.raises(BadRequest, match=problem):
        wire.decode([wire.VERSION, b"\x01", body])


def test_oversized_bodies_are_refused_before_decoding() -> None:
    with pytest.raises(ProtocolError, match="over the limit"):
        wire.decode_body(wire.MsgType.PING, b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))


def test_the_id_of_an_invalid_request_can_still_be_read() -> None:
    assert wire.peek_id(msgpack.packb({"id": "abc", "params": 5})) == "abc"
    assert wire.peek_id(b"\xc1") is None
    token_prompt = wire.Request("tok1", "", "no-such-model", tokens=wire.pack_tokens([0, 1]))  # a bin field
    assert wire.peek_id(wire.pack(token_prompt)) == "tok1"


@pytest.mark.parametrize("body, problem", [
    ({"id": "c", "op": "grow", "model": "m"},
     "'op' must be one of models, load, unload, scale, add, reload, got 'grow'"),
    ({"id": "c", "op": "load"}, "'model' is needed for load"),
    ({"id": "c", "op": "scale", "model": "m"}, "scale needs 'min', 'max' or both"),
    ({"id": "c", "op": "scale", "model": "m", "min": -1}, "'min' must be between 0 and 256, got -1"),
    ({"id": "c", "op": "scale", "model": "m", "max": 0}, "'max' must be between 1 and 256, got 0"),
    ({"id": "c", "op": "scale", "model": "m", "min": "1"}, "field 'min' must be an integer"),
    ({"id": "c", "op": "scale", "model": "m", "min": 3, "max": 2}, r"'min' \(3\) is above 'max' \(2\)"),
    ({"id": "c", "op": "add"}, "'path' is needed for add"),
    ({"id": "c", "op": "load", "model": "m", "path": "/m.gguf"}, "'path' is for add, not load"),
])
def test_control_calls_are_checked_naming_the_parameter(body: dict, problem: str) -> None:
    with pytest.raises(BadRequest, match=problem):
        wire.decode_as(wire.Control, wire.pack(body))


def test_model_stats_from_a_newer_server_keep_the_fields_this_client_knows() -> None:
    body = msgpack.unpackb(wire.pack(wire.Stats(0, True, {}, {"m": wire.ModelStats(1, 0, 1, 0)})))
    body["models"]["m"]["later_field"] = 1
    body["models"]["m"]["scaling"]["later_too"] = 2
    assert wire.decode_as(wire.Stats, wire.pack(body)).models["m"] == wire.ModelStats(1, 0, 1, 0)
    del body["models"]["m"]["scaling"]  # and from an older server, without scaling
    assert wire.decode_as(wire.Stats, wire.pack(body)).models["m"].scaling == wire.ModelScaling()


_ODD = [None, True, False, 0, -1, 7, 1.5, -0.5, float("nan"), float("inf"), 2**40, "", "x", "x" * 70, "é" * 300,
        b"", b"\x01\x00\x00\x00", b"\xff\xff\xff\xff", b"\x01", [], ["a"], [1, 2], [[5, 1.0]], {}, {"a": 1},
        {"5": 1.0}]


def _outcome(decode: Any, body: bytes) -> object:
    try:
        return decode(body)
    except MpserveError as exc:
        return (type(exc), exc.message)


@pytest.mark.parametrize("seed", range(300))
def test_any_request_or_assign_is_decoded_or_refused_naming_its_problem(seed: int) -> None:
    """REQUEST and ASSIGN(S) are decoded once, by msgspec: for any body, the message, or a BadRequest or
    ProtocolError whose message names the field (a refused parameter is a BadRequest, a refused id a
    ProtocolError), never another exception."""
    rng = random.Random(seed)
    request: dict[str, Any] = {"id": "r1", "prompt": "hello", "model": "m", "stream": True, "timeout": 5.0,
                               "params": {"max_tokens": 4, "temperature": 0.0, "stop": ["\n"], "seed": 3}}
    for _ in range(rng.randint(0, 3)):
        params = request.get("params")
        where = params if isinstance(params, dict) and rng.random() < 0.6 else request
        key = rng.choice([*(wire.GenerateParams.__struct_fields__ if where is not request else
                            wire.Request.__struct_fields__), "bogus"])
        if rng.random() < 0.15:
            where.pop(key, None)
        else:
            where[key] = rng.choice(_ODD)
    assign: dict[str, Any] = {"ticket": rng.choice(["t1", "t" * 70]), "request": request, "queue_ms": 0.5,
                              "attempt": 1, "slot": rng.choice([0, 1, "0"]), "index": rng.choice([0, 3, 200, -1]),
                              "generated": rng.choice([b"", b"\x01\x00\x00\x00", b"\x01"])}
    valid = {"ticket": "t0", "request": {"id": "r0", "prompt": "hi"}, "queue_ms": 0, "attempt": 1}
    for mtype, body in ((wire.MsgType.REQUEST, request), (wire.MsgType.ASSIGN, assign),
                        (wire.MsgType.ASSIGNS, [valid, assign] if seed % 2 else [assign, valid])):
        outcome = _outcome(lambda b, t=mtype: wire.decode_body(t, b), msgpack.packb(body, use_bin_type=True))
        if isinstance(outcome, tuple):
            kind, message = outcome
            assert kind in (BadRequest, ProtocolError) and "'" in message, (body, outcome)
            assert kind is ProtocolError or not re.search(r"^(field )?'(id|ticket)'", message), (body, outcome)


def test_parameters_seen_valid_pass_again_and_invalid_ones_are_refused_every_time() -> None:
    for _ in range(3):
        with pytest.raises(BadRequest, match="'top_p' must be between"):
            wire.GenerateParams(top_p=1.5).validate()
        with pytest.raises(BadRequest, match="finite"):
            wire.GenerateParams(temperature=float("nan")).validate()
        wire.GenerateParams(top_p=0.5, stop=("x",)).validate()
    with pytest.raises(BadRequest, match="'ignore_eos' must be a boolean"):  # unhashable: still named
        wire.GenerateParams(ignore_eos=[True]).validate()
    wire.GenerateParams(stop=["x"]).validate()
    for i in range(3 * messages._VALID_KEPT):  # distinct valid sets: the memo stays bounded
        wire.GenerateParams(max_tokens=1 + i).validate()
    assert len(messages._VALID) <= messages._VALID_KEPT


def test_a_body_nested_past_the_decoders_depth_is_refused_and_has_no_id() -> None:
    deep = b"\x81\xa2id" + b"\x91" * 100_000 + b"\xc0"  # {"id": [[[...nil...]]]}
    with pytest.raises(ProtocolError):  # the broker answers it with an ERROR, without its id
        wire.decode([wire.VERSION, b"\x01", deep])
    assert wire.peek_id(deep) is None


@pytest.mark.parametrize("mtype, body, error", [
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "p", "later": 1}, BadRequest),
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "p", "params": {"later": 1}}, BadRequest),
    (wire.MsgType.CONTROL, {"id": "c", "op": "models", "later": 1}, BadRequest),
    (wire.MsgType.PING, {"nonce": 1, "later": 1}, ProtocolError),
    (wire.MsgType.DONE, {"id": "r", "text": "", "finish_reason": "stop", "usage": {}, "timings": {}, "later": 1},
     ProtocolError),
])
def test_a_field_the_receiver_does_not_know_is_refused_naming_it(mtype: wire.MsgType, body: dict[str, Any],
                                                                 error: type[MpserveError]) -> None:
    with pytest.raises(error, match="unknown (field|parameter) 'later'; allowed: "):
        wire.decode_body(mtype, msgpack.packb(body))


def test_a_usage_without_thinking_is_what_a_client_from_before_reasoning_tokens_decodes() -> None:
    import msgspec

    class Before(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        prompt_tokens: int = 0
        completion_tokens: int = 0

    assert msgspec.msgpack.decode(wire.pack(wire.Usage(3, 4)), type=Before) == Before(3, 4)
    assert wire.decode_as(wire.Usage, wire.pack(wire.Usage(3, 4, 2))).reasoning_tokens == 2
