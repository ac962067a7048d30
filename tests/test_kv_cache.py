"""The engine's KV memory, in-process: each KV type llama.cpp offers reaches its context and quantized ones
take less memory (on the bench model: heads of 64 elements, whole blocks of every quantized type); the
host-RAM prompt cache keeps what slots lose and restores it exactly (on the tiny model)."""

from __future__ import annotations

import json
import logging
import os
import stat
import struct
import tempfile
from pathlib import Path

import llama_cpp
import pytest
from conftest import RealModel, ServerProcess
from engines import LONG_PROMPT as LONG
from engines import others, run
from helpers import mpserve

from mpserve import Client
from mpserve.config.kv_types import KV_TYPES
from mpserve.engine import slot_file, vocab
from mpserve.engine.batch import BatchEngine
from mpserve.engine.sequence import ENDING_TOKENS, PROMPT_CHUNK, TAIL_TOKENS
from mpserve.engine.settings import EngineSettings
from mpserve.engine.store_stats import CacheStats
from mpserve.errors import BadRequest
from mpserve.models.builtin import builtin_model_path
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import PREFIX_BLOCK, block_hashes

PROMPT = "Once upon a time in the land of"


@pytest.mark.timeout(180)
def test_every_kv_type_generates_and_a_quantized_cache_holds_fewer_bytes() -> None:
    path = str(builtin_model_path("bench"))
    state_bytes = {}
    for name in KV_TYPES:
        engine = BatchEngine(EngineSettings(path, n_ctx=128, parallel=1, threads=1, n_gpu_layers=0, flash_attn="on",
                                            cache_type_k=name, cache_type_v=name))
        try:
            assert run(engine, 0, PROMPT, 8).text, name
            state_bytes[name] = llama_cpp.llama_state_seq_get_size(engine._context.ctx, 0)
        finally:
            engine.close()
    assert state_bytes["q8_0"] < state_bytes["f16"] == state_bytes["bf16"] < state_bytes["f32"]
    assert state_bytes["q4_0"] < state_bytes["q5_0"] < state_bytes["q8_0"]


# --- the host-RAM prompt cache ---------------------------------------------------------------------------

def fresh_store() -> str:
    """A host store of its own (an empty RAM tier), so that what a test counts is its own engine's doing."""
    return tempfile.mkdtemp(dir=os.environ["MPSERVE_CACHE_SHM"] if os.path.isdir(os.environ["MPSERVE_CACHE_SHM"])
                            else None)


def tiny_engine(parallel: int, cache_ram: int, kv_unified: bool = False, reuse: str = "exact",
                store: str | None = None) -> BatchEngine:
    """``reuse`` exact unless told: most tests here compare with a fresh computation. A store of its own unless
    given one."""
    return BatchEngine(EngineSettings(str(builtin_model_path("tiny")), n_ctx=1024, parallel=parallel, threads=1,
                                      n_gpu_layers=0, kv_unified=kv_unified, cache_ram=cache_ram,
                                      cache_shm=store or fresh_store(), reuse=reuse))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kv_unified", [False, True], ids=["kv-per-slot", "kv-unified"])
def test_a_prompt_pushed_out_of_every_slot_is_restored_from_ram_and_continues_exactly(kv_unified: bool) -> None:
    follow_up = LONG + " and then the cat sat"
    fresh = tiny_engine(1, 0)
    try:
        expected = run(fresh, 0, follow_up)
    finally:
        fresh.close()
    assert expected.reused_tokens == 0
    engine = tiny_engine(2, 64 << 20, kv_unified)
    try:
        run(engine, 0, LONG)
        for i, prompt in enumerate(others(8)):  # 8 other prompts, over both slots: LONG's cells are gone
            run(engine, i % 2, prompt)
        long = engine._context.tokenize_prompt(LONG)
        assert all(engine.kv_cells(slot) and engine._cells.cached[slot][1:4] != long[1:4] for slot in (0, 1))
        before = engine.stats()
        again = run(engine, 1, follow_up)
        after = engine.stats()
        assert again.reused_tokens == PROMPT_CHUNK  # restored: whole chunks, the rest computed as fresh
        assert after.prompt_tokens_restored - before.prompt_tokens_restored == PROMPT_CHUNK
        assert after.prompt_tokens_computed - before.prompt_tokens_computed == again.prompt_tokens - PROMPT_CHUNK
        assert again.text == expected.text  # greedy text equals a fresh computation
        stats = engine.cache_stats()
        assert stats.hits == 1 and stats.entries >= 2 and 0 < stats.bytes <= stats.capacity
    finally:
        engine.close()


def store_changes(engine: BatchEngine) -> wire.CacheChanges:
    """The store's changes, once the writes queued are made."""
    assert engine._keeping.store is not None
    engine._keeping.store.flush()
    return engine.take_cache_changes()


@pytest.mark.timeout(120)
def test_a_saved_entry_is_told_with_the_block_hashes_of_the_text_its_tokens_spell_one_of_token_ids_without() -> None:
    engine = tiny_engine(1, 64 << 20)
    try:
        run(engine, 0, LONG)  # its whole chunks are saved into the store once they are computed
        (_, packed), = store_changes(engine).added
        tokens = engine._context.tokenize_prompt(LONG)
        whole = (len(tokens) - 1) // PROMPT_CHUNK * PROMPT_CHUNK  # what a later prompt can reuse of it
        spelled = vocab.detokenize(llama_cpp, engine._context.vocab, tokens[1:whole])  # after BOS
        assert LONG.startswith(spelled) and len(spelled) >= 2 * PREFIX_BLOCK
        assert wire.unpack_hashes(packed) == block_hashes(spelled)  # what the broker computes of LONG, that far
        assert not engine.take_cache_changes()  # told once
        # a prompt of token ids is saved with nothing to route by
        run(engine, 0, engine._context.tokenize_prompt(others(1)[0]))
        assert not store_changes(engine) and engine.cache_stats().entries == 2
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_filling_the_store_past_its_size_evicts_and_recent_entries_still_hit() -> None:
    probe = tiny_engine(1, 64 << 20)
    try:
        run(probe, 0, others(1)[0])
        assert probe._keeping.store is not None
        probe._keeping.store.flush()
        entry_bytes = probe.cache_stats().bytes  # one entry: one chunk of cells
    finally:
        probe.close()
    assert entry_bytes > 0
    capacity = int(2.5 * entry_bytes)  # room for two entries
    engine = tiny_engine(1, capacity)
    try:
        prompts = others(6)
        for prompt in prompts:
            run(engine, 0, prompt, 4)
            store_changes(engine)
            stats = engine.cache_stats()
            assert stats.bytes <= capacity and stats.entries <= 2
        stats = engine.cache_stats()
        assert stats.evictions == 4 and stats.entries == 2  # 6 saved, 2 kept
        assert run(engine, 0, prompts[4] + " more", 4).reused_tokens == PROMPT_CHUNK  # recent: a hit
        assert run(engine, 0, prompts[0] + " more", 4).reused_tokens == 0  # evicted: a miss
        stats = engine.cache_stats()
        assert stats.hits == 1 and stats.misses >= 1 and stats.bytes <= capacity
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_with_reuse_any_a_conversation_pushed_out_continues_from_its_reply() -> None:
    """``reuse: any`` keeps all of a slot's cells, the reply's included: the next turn restores them and computes
    only the new turn, however many chunks they make."""
    engine = tiny_engine(1, 64 << 20, reuse="any")
    try:
        first = run(engine, 0, LONG[:3000])
        run(engine, 0, others(1)[0])  # pushes the conversation out of the only slot, into the cache
        before = engine.stats()
        turn = LONG[:3000] + first.text + " and then"
        second = run(engine, 0, turn, 4)
        after, cache = engine.stats(), engine.cache_stats()
    finally:
        engine.close()
    assert first.prompt_tokens % PROMPT_CHUNK and second.reused_tokens > first.prompt_tokens  # the reply's cells too
    assert after.prompt_tokens_restored - before.prompt_tokens_restored == second.reused_tokens
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == second.prompt_tokens - second.reused_tokens
    assert cache.hits == 1


@pytest.mark.timeout(120)
def test_an_engine_closed_leaves_what_its_slots_hold_in_the_store_and_the_next_one_continues_from_it() -> None:
    """An unload (a single-active-backend swap, a scale-down) closes the engine: its slots' cells, the reply's
    included, go to the host store, and the next instance continues the conversation from them."""
    store = fresh_store()
    engine = tiny_engine(2, 64 << 20, reuse="any", store=store)
    try:
        first = run(engine, 1, LONG[:3000])
    finally:
        engine.close()
    engine = tiny_engine(2, 64 << 20, reuse="any", store=store)
    try:
        second = run(engine, 0, LONG[:3000] + first.text + " and then", 4)
    finally:
        engine.close()
    assert first.prompt_tokens % PROMPT_CHUNK and second.reused_tokens > first.prompt_tokens  # the reply's cells too


@pytest.mark.timeout(60)
def test_cache_ram_zero_keeps_nothing() -> None:
    engine = tiny_engine(1, 0)
    try:
        run(engine, 0, LONG)
        run(engine, 0, others(1)[0])
        assert run(engine, 0, LONG + " more").reused_tokens == 0
        assert engine.cache_stats() == CacheStats(0, 0, 0, 0, 0, 0) and engine._keeping.store is None
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_through_the_server_a_prompt_pushed_out_of_every_slot_reports_restored_tokens_as_cached(
        start_server: type[ServerProcess]) -> None:
    server = start_server("--parallel", "2", "--n-ctx", "1024", "--cache-ram", "64MiB",
                          "--reuse", "exact").wait_ready()
    follow_up = LONG + " and then the cat sat"
    with Client(server.address, timeout=60) as client:
        first = client.generate(LONG, max_tokens=8, temperature=0)
        assert first.timings.cached_tokens == 0
        for prompt in others(8):  # unrelated prompts, over both slots
            client.generate(prompt, max_tokens=8, temperature=0)
        again = client.generate(follow_up, max_tokens=16, temperature=0)
    assert again.timings.cached_tokens == PROMPT_CHUNK
    cache = server.slots()[0].cache
    assert cache.hits == 1 and 0 < cache.bytes <= cache.capacity == 64 << 20
    fresh = tiny_engine(1, 0)
    try:
        assert again.text == run(fresh, 0, follow_up).text
    finally:
        fresh.close()
    status = mpserve("status", "--server-name", server.name, timeout=30)
    assert status.stdout.count("of 64.0 MiB") == 1, status.stdout  # the host's figure, once
    assert "\nhost store (host-wide, every model and server on this host): RAM " in status.stdout
    assert "KV cells" in status.stdout and "; host store: 1 hits, " in status.stdout


@pytest.mark.timeout(120)
def test_with_two_instances_a_prompt_one_computed_is_restored_by_the_other_from_the_host_store(
        start_server: type[ServerProcess]) -> None:
    server = start_server("--instances", "2", "--parallel", "1", "--n-ctx", "1024", "--cache-ram", "64MiB",
                          "--reuse", "exact").wait_ready()
    follow_up = LONG + " and then the cat sat"
    with Client(server.address, timeout=60) as client:
        first = client.generate(LONG, max_tokens=8, temperature=0)
        holder = first.worker
        served = [client.generate(prompt, max_tokens=8, temperature=0).worker for prompt in others(8)]
        other = served[0]
        # one at a time, each to the instance free the longest: the other one first, then in turn, so LONG left
        # its instance's slot (for its RAM) and the other instance, never given LONG, is now free the longest
        assert other != holder and served == [other, holder] * 4
        again = client.generate(follow_up, max_tokens=16, temperature=0)
        counters = client.stats().counters
    # the store is the host's: the instance that never computed LONG restores it, being free the longest
    assert again.worker == other and again.timings.cached_tokens == PROMPT_CHUNK
    assert counters["routed_ram_prefix"] == 1 and counters["routed_least_busy"] == 9
    fresh = tiny_engine(1, 0)
    try:
        assert again.text == run(fresh, 0, follow_up).text
    finally:
        fresh.close()


@pytest.mark.timeout(60)
def test_a_cache_ram_that_is_not_a_size_stops_the_start_before_anything_starts() -> None:
    proc = mpserve("start", "--cache-ram", "lots", timeout=30)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cache_ram: memory size 'lots' is not understood" in proc.stderr
    proc = mpserve("start", "--cache-type-k", "q9", timeout=30)
    assert proc.returncode == 1 and "cache_type_k: got 'q9', allowed: f32, f16, bf16" in proc.stderr


# --- slot files ----------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_slot_saved_to_disk_continues_exactly_in_another_engine(tmp_path: Path) -> None:
    follow_up = LONG + " and then the cat sat"
    saver = tiny_engine(2, 0)
    try:
        run(saver, 1, LONG)
        held = saver.kv_cells(1)
        assert saver.save_slot(1, tmp_path / "conversation.bin") == held
    finally:
        saver.close()
    engine = tiny_engine(2, 0)  # another process's engine would do the same: nothing is shared but the file
    try:
        assert engine.restore_slot(0, tmp_path / "conversation.bin") == held and engine.kv_cells(0) == held
        again = run(engine, 0, follow_up)
        assert again.reused_tokens == PROMPT_CHUNK
        assert engine.erase_slot(0) > 0 and engine.kv_cells(0) == 0
        fresh = run(engine, 0, follow_up)
        assert fresh.reused_tokens == 0 and again.text == fresh.text
    finally:
        engine.close()


def with_header(data: bytes, **changes: object) -> bytes:
    """A slot file's bytes with some header fields changed."""
    start = len(slot_file.MAGIC) + 4
    (length,) = struct.unpack_from("<I", data, len(slot_file.MAGIC))
    header = json.dumps({**json.loads(data[start:start + length]), **changes}).encode()
    return slot_file.MAGIC + struct.pack("<I", len(header)) + header + data[start + length:]


@pytest.mark.timeout(120)
def test_a_foreign_or_truncated_slot_file_is_refused_saying_which_and_the_slot_stays_usable(tmp_path: Path) -> None:
    engine = tiny_engine(1, 0)
    try:
        run(engine, 0, LONG)
        engine.save_slot(0, tmp_path / "good.bin")
        data = (tmp_path / "good.bin").read_bytes()
        (tmp_path / "short.bin").write_bytes(data[:-100])
        (tmp_path / "junk.bin").write_bytes(b"hello, not a slot at all")
        (tmp_path / "other-parallel.bin").write_bytes(with_header(data, kv_streams=2))
        (tmp_path / "other-kv.bin").write_bytes(with_header(data, cache_type_k="q8_0"))
        (tmp_path / "other-model.bin").write_bytes(with_header(data, model="gemma3 270M Q4_K - Medium"))
        held = engine.kv_cells(0)
        for name, problem in (("short.bin", "'short.bin' is truncated: "), ("junk.bin", "not an mpserve slot file"),
                              ("other-kv.bin", "saved with KV cache types q8_0/f16; this instance uses f16/f16"),
                              ("other-model.bin", "was saved from another model"), ("none.bin", "no slot file"),
                              ("other-parallel.bin", "instance with 2 KV stream\\(s\\).*this one has 1")):
            with pytest.raises(BadRequest, match=problem):
                engine.restore_slot(0, tmp_path / name)
            assert engine.kv_cells(0) == held  # refused before llama.cpp saw it: the slot keeps its cells
        assert run(engine, 0, LONG + " more").reused_tokens == PROMPT_CHUNK  # and works as before
    finally:
        engine.close()


@pytest.mark.timeout(120)
def test_a_slot_file_is_its_users_alone_and_a_link_or_a_negative_count_is_refused(tmp_path: Path) -> None:
    engine = tiny_engine(1, 0)
    try:
        run(engine, 0, LONG)
        (tmp_path / ".good.bin.tmp").symlink_to(tmp_path / "victim")  # a planted link at the temporary name
        engine.save_slot(0, tmp_path / "good.bin")
        assert stat.S_IMODE((tmp_path / "good.bin").stat().st_mode) == 0o600 and not (tmp_path / "victim").exists()
        (tmp_path / "link.bin").symlink_to(tmp_path / "good.bin")
        (tmp_path / "negative.bin").write_bytes(with_header((tmp_path / "good.bin").read_bytes(), n_tokens=-1))
        held = engine.kv_cells(0)
        for name, problem in (("link.bin", "'link.bin' is not a slot file of this server's"),
                              ("negative.bin", "'negative.bin' is truncated or damaged")):
            with pytest.raises(BadRequest, match=problem):
                engine.restore_slot(0, tmp_path / name)
            assert engine.kv_cells(0) == held
    finally:
        engine.close()


@pytest.mark.timeout(180)
def test_a_slot_saved_with_the_cli_survives_a_restart_and_bad_files_are_refused(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    args = ("--n-ctx", "1024", "--cache-ram", "0", "--slot-save-path", str(tmp_path), "--reuse", "exact")
    follow_up = LONG + " and then the cat sat"
    server = start_server(*args).wait_ready()
    with Client(server.address, timeout=60) as client:
        client.generate(LONG, max_tokens=8, temperature=0)
    saved = mpserve("slots", "save", "0", "talk.bin", "--server-name", server.name)
    assert saved.returncode == 0 and saved.stdout.startswith("saved slot 0 (w0 slot 0): "), saved.stderr
    assert server.stop() == 0

    server = start_server(*args).wait_ready()  # a new server: nothing in its slots
    name = ("--server-name", server.name)
    (tmp_path / "cut.bin").write_bytes((tmp_path / "talk.bin").read_bytes()[:-10])
    for file, problem in (("cut.bin", "'cut.bin' is truncated"), ("../talk.bin", "file name '../talk.bin' is not "
                                                                                 "allowed")):
        refused = mpserve("slots", "restore", "0", file, *name)
        assert refused.returncode == 1 and problem in refused.stderr and "Traceback" not in refused.stderr
    restored = mpserve("slots", "restore", "0", "talk.bin", "--json", *name)
    assert restored.returncode == 0, restored.stderr
    assert json.loads(restored.stdout)["tokens"] == server.slots()[0].kv_cells > PROMPT_CHUNK
    with Client(server.address, timeout=60) as client:
        again = client.generate(follow_up, max_tokens=16, temperature=0)
    assert again.timings.cached_tokens == PROMPT_CHUNK
    fresh = tiny_engine(1, 0)
    try:
        assert again.text == run(fresh, 0, follow_up).text  # restored from disk: as a fresh computation
    finally:
        fresh.close()
    erased = mpserve("slots", "erase", "0", *name)
    assert erased.returncode == 0 and server.slots()[0].kv_cells == 0
    assert "no slot 7" in mpserve("slots", "erase", "7", *name).stderr


@pytest.mark.real
@pytest.mark.timeout(300)
def test_on_the_real_model_a_state_restored_from_ram_continues_exactly(real_model: RealModel) -> None:
    """Gemma 3 (sliding-window layers) with a quantized KV cache: its restored cells give what a fresh
    computation of the prompt gives."""
    kv = "q8_0"
    long = " ".join(f"The {w} of all things is a story." for w in ("cat", "dog", "sea", "sky") * 20)
    other = " ".join(f"So {w} and it went on." for w in ("ant", "bee", "owl", "elk") * 25)  # pushes it out
    follow_up = long + " And then"

    def engine(cache_ram: int) -> BatchEngine:
        return BatchEngine(EngineSettings(real_model.path, n_ctx=2048, parallel=1, threads=1, n_gpu_layers=0,
                                          repack=real_model.repack, cache_type_k=kv, cache_type_v=kv,
                                          cache_ram=cache_ram, cache_shm=fresh_store(), reuse="exact"))

    fresh = engine(0)
    try:
        expected = run(fresh, 0, follow_up)
    finally:
        fresh.close()
    cached = engine(256 << 20)
    try:
        run(cached, 0, long)
        run(cached, 0, other)
        again = run(cached, 0, follow_up)
    finally:
        cached.close()
    assert again.reused_tokens == PROMPT_CHUNK and again.text == expected.text


def _gemma(real_model: RealModel, cache_ram: int, reuse: str) -> BatchEngine:
    return BatchEngine(EngineSettings(real_model.path, n_ctx=2048, parallel=1, threads=1, n_gpu_layers=0,
                                      repack=real_model.repack, cache_ram=cache_ram, cache_shm=fresh_store(),
                                      reuse=reuse))


def _long_other_branch(engine: BatchEngine) -> tuple[list[int], list[int], list[int]]:
    """A prompt of two whole chunks and more, an unrelated one, and one sharing a chunk and 200 tokens of the
    first."""
    words = (" ".join(f"Line {i} says the {w} went to the {v}." for i, (w, v) in
                      enumerate(zip(("cat", "dog", "owl") * 60, ("sea", "hill", "town", "wood") * 45, strict=True)))
             + " " + " ".join(f"So {w} and it went on." for w in ("ant", "bee", "owl", "elk") * 5))
    long = engine._context.tokenize_prompt(words)[:2 * PROMPT_CHUNK + 300]
    other = engine._context.tokenize_prompt(" ".join(f"Row {i} of the other table." for i in range(40)))
    branch = long[:PROMPT_CHUNK + 200] + engine._context.tokenize_prompt(" And then the whale sang a song.")[1:]
    return long, other, branch


@pytest.mark.real
@pytest.mark.timeout(600)
def test_on_a_sliding_window_model_a_prompt_sharing_part_of_a_slot_s_restored_cells_is_said_to_restore_instead(
        real_model: RealModel, caplog: pytest.LogCaptureFixture) -> None:
    """A slot holding a restored state (whose windowed layers keep only its last cells) cannot keep a part of it
    for a prompt that shares only that part; the log says what happens then, and it happens: a checkpoint is
    restored, nothing is computed from the start."""
    engine = _gemma(real_model, 256 << 20, "any")
    try:
        long, other, branch = _long_other_branch(engine)
        run(engine, 0, long)
        run(engine, 0, other)  # the long prompt's cells go to the store
        # restored whole: the slot holds restored cells
        run(engine, 0, long + engine._context.tokenize_prompt(" The end.")[1:])
        with caplog.at_level(logging.INFO, logger="mpserve.worker"):
            again = run(engine, 0, branch)
    finally:
        engine.close()
    assert again.reused_tokens == PROMPT_CHUNK  # the checkpoint at the first whole chunk, restored
    said = [r.getMessage() for r in caplog.records if "sliding-window" in r.getMessage()]
    assert len(said) == 1 and "restores instead the host store's longest entry that is all prefix of it" in said[0]
    assert "computed from the start" not in said[0]


@pytest.mark.real
@pytest.mark.timeout(600)
@pytest.mark.parametrize("reuse", ["any", "exact"])
def test_on_a_sliding_window_model_a_prompt_sharing_part_of_a_longer_entry_restores_a_checkpoint(
        real_model: RealModel, reuse: str) -> None:
    """Gemma 3 (a window of 512 on most layers): a saved state keeps only its window's last cells on those layers,
    so an entry longer than the prefix a prompt shares cannot be cut back to it. The prompt restores the longest
    entry that is all prefix (a checkpoint its prompt saved at a whole chunk) instead of computing from the start,
    and its greedy text equals a fresh computation."""

    def engine(cache_ram: int) -> BatchEngine:
        return _gemma(real_model, cache_ram, reuse)

    cached = engine(256 << 20)
    try:
        long, other, branch = _long_other_branch(cached)
        run(cached, 0, long)
        run(cached, 0, other)  # pushes the long prompt's cells out of the only slot, into the store
        before = cached.stats()
        again = run(cached, 0, branch)
        after = cached.stats()
    finally:
        cached.close()
    fresh = engine(0)
    try:
        expected = run(fresh, 0, branch)
    finally:
        fresh.close()
    assert again.reused_tokens == PROMPT_CHUNK  # the checkpoint at the first whole chunk
    assert after.prompt_tokens_restored - before.prompt_tokens_restored == PROMPT_CHUNK
    assert after.prompt_tokens_computed - before.prompt_tokens_computed == len(branch) - PROMPT_CHUNK
    assert again.text == expected.text


ENDINGS = {  # the first ask's ending and the second's, and the mark before the end that the second restores up to
    "short": (" First question?", " Second question?", TAIL_TOKENS),
    "long": (" First question, about the cat and the sea: where did the cat go, and what did it find there?",
             " Second question?", ENDING_TOKENS + TAIL_TOKENS)}


@pytest.mark.real
@pytest.mark.timeout(600)
@pytest.mark.parametrize("endings", ENDINGS.values(), ids=ENDINGS.keys())
def test_on_a_sliding_window_model_a_prompt_asked_again_with_another_ending_restores_all_but_its_last_tokens(
        real_model: RealModel, endings: tuple[str, str, int]) -> None:
    """With ``reuse: any`` a prompt's cells are saved before its last TAIL_TOKENS and before its last ENDING_TOKENS +
    TAIL_TOKENS: the same long prompt with another ending, after the instance that computed it is gone (a swap, an
    unload), restores all but those: the nearest mark before the endings part."""
    store = fresh_store()

    def engine() -> BatchEngine:
        return BatchEngine(EngineSettings(real_model.path, n_ctx=2048, parallel=1, threads=1, n_gpu_layers=0,
                                          repack=real_model.repack, cache_ram=256 << 20, cache_shm=store, reuse="any"))

    first = engine()
    try:
        words = " ".join(f"Line {i} says the cat went to the sea." for i in range(120))
        long = first._context.tokenize_prompt(words)[:PROMPT_CHUNK + 300]
        ending = first._context.tokenize_prompt(endings[0])[1:]
        run(first, 0, long + ending)
    finally:
        first.close()
    second = engine()
    try:
        again = run(second, 0, long + second._context.tokenize_prompt(endings[1])[1:])
    finally:
        second.close()
    mark = endings[2]
    assert len(ending) <= mark and (mark == TAIL_TOKENS or len(ending) > TAIL_TOKENS)  # after this mark, no later one
    assert again.reused_tokens == len(long) + len(ending) - mark
