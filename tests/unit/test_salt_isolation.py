"""Nothing computed under one reuse salt is reused under another (``mpserve.wire.salt``): a slot's own cells,
another slot's copied, twins sharing a prompt, the host store's entries in both tiers, and the broker's routing by
slot prompts and by block hashes. The empty salt (the default tenant) shares as before."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_fakes import FakeMemory, sequence

from mpserve.engine.cells import Cells
from mpserve.engine.host_store import HostStore, compatibility_key
from mpserve.engine.keeping import Keeping
from mpserve.engine.scheduler import Scheduler
from mpserve.engine.sequence import PROMPT_CHUNK, Sequence
from mpserve.server.routing import Source, choose_slots
from mpserve.server.state import WorkerEntry
from mpserve.wire import protocol as wire
from mpserve.wire.prefix import PREFIX_BLOCK, block_hashes
from mpserve.wire.salt import reuse_salt

pytestmark = pytest.mark.timeout(30)

SA, SB = reuse_salt("key:" + "a" * 16, None, ()), reuse_salt("key:" + "b" * 16, None, ())
SHARED = reuse_salt("key:" + "a" * 16, "public", ())
A = list(range(1, 2 * PROMPT_CHUNK + 100))
KEY = compatibility_key({"model": "salts"})


def cells(memory: FakeMemory, running: dict[int, Sequence] | None = None) -> Cells:
    return Cells(memory, len(memory.cells), {} if running is None else running, exact=False, kv_unified=False,
                 n_swa=1, has_store=True)


def held(c: Cells, memory: FakeMemory, slot: int, tokens: list[int], salt: bytes) -> None:
    memory.fill(slot, len(tokens))
    c.start(slot, tokens, len(tokens), "", salt)


def test_a_slots_cells_are_reused_and_taken_under_their_own_salt_only() -> None:
    memory = FakeMemory(2)
    c = cells(memory)
    held(c, memory, 0, A, SA)
    prompt = A + [5]
    assert c.reusable(0, prompt, SB) == 0 and c.reusable(0, prompt, b"") == 0
    assert c.reusable(0, prompt, SA) == len(A)
    assert c.best_slot([0, 1], prompt, SB)[1] == 0
    assert c.take_cells(0, prompt, SB) == 0 and memory.cells[0] == []  # cut: B starts from nothing


def test_another_slots_cells_are_copied_under_the_same_salt_only() -> None:
    memory = FakeMemory(3)
    seqs: dict[int, Sequence] = {}
    c = cells(memory, seqs)
    held(c, memory, 0, A, SA)
    assert c.copy_source(1, A + [5], SB)[1] == 0
    for slot, salt in ((1, SB), (2, SA)):
        seq = sequence(slot, A + [5])
        seq.salt = salt
        seqs[slot] = seq
        c.start(slot, seq.prompt, 0, "", salt)
    c.catch_up([seqs[1], seqs[2]])
    assert seqs[1].n_past == 0 and memory.cells[1] == []  # B computes its prompt itself
    assert seqs[2].n_past == len(A)  # A's next request copies


def test_a_cache_salt_named_by_two_tenants_shares_their_cells() -> None:
    memory = FakeMemory(2)
    c = cells(memory)
    held(c, memory, 0, A, SHARED)
    assert c.reusable(0, A + [5], reuse_salt("key:" + "b" * 16, "public", ())) == len(A)


def test_twins_and_prompts_being_computed_are_shared_under_one_salt_only() -> None:
    scheduler = Scheduler(4096, exact=False, kv_unified=False, exact_rows=7)
    lead, twin, other = sequence(0, A), sequence(1, A), sequence(2, A)
    lead.salt = twin.salt = SA
    other.salt = SB
    for seq in (lead, twin, other):
        scheduler.add(seq)
    twins = scheduler.twins(lead)
    assert twin in twins and other not in twins
    assert [s.slot for s in scheduler.chunks(False)] == [0, 2]  # B's equal prompt is computed, not waited for


class States(FakeMemory):
    """The fake memory, whose saved state is the count of cells it holds."""

    bos: list[int] = []

    def read_state(self, slot: int) -> tuple[Any, int]:
        return bytearray(struct.pack("<I", len(self.cells[slot]))), 4

    def write_state(self, slot: int, state: Any, size: int) -> bool:
        self.fill(slot, struct.unpack("<I", bytes(state)[:4])[0])
        return True

    def detokenize(self, tokens: list[int]) -> str:
        return ""


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    yield tmp_path / "ram", tmp_path / "disk"


def store(tiers: tuple[Path, Path], ram: int = 1 << 20) -> HostStore:
    return HostStore(KEY, {"model": "salts"}, tiers[0], ram, tiers[1], 1 << 20)


def test_a_slots_cells_kept_in_the_host_store_are_restored_under_their_salt_only(tiers: tuple[Path, Path]) -> None:
    memory = States(2)
    c = cells(memory)
    s = store(tiers)
    keeping = Keeping(s, c, memory, exact=False, cut_back=True)
    held(c, memory, 0, A, SA)
    keeping.keep(0, [9] * 10, SB)  # B's prompt takes slot 0: A's cells go to the store, under A's salt
    s.flush()
    c.erase(0)
    assert s.holds(A, SA) and not s.holds(A, SB) and not s.holds(A)
    assert keeping.restore(1, A + [5], 0, SB) == 0
    assert keeping.restore(1, A + [5], 0, SA) == len(A)
    s.close()


def test_host_store_entries_of_one_salt_are_never_found_for_another_in_either_tier(tiers: tuple[Path, Path]) -> None:
    s = store(tiers)
    tokens = tuple(range(PROMPT_CHUNK))
    s.put(tokens, bytearray(64), 64, (), SA)
    s.put(tokens[:100], bytearray(64), 64, (), b"")
    s.flush()
    assert s.find(tokens + (1,), SB) == (None, 0)
    assert s.find(tokens + (1,), b"")[1] == 100  # the default tenant's own, shorter entry
    entry, shared = s.find(tokens + (1,), SA)
    assert entry is not None and entry.salt == SA and shared == PROMPT_CHUNK
    s.put(tokens, bytearray(64), 64, (), SB)  # B computing the same prefix: an entry of its own
    s.flush()
    assert len(list((tiers[0] / KEY).glob("*.kv"))) == 3
    s.close()
    for name in (tiers[0] / KEY).glob("*.kv"):
        name.unlink()  # RAM emptied (a reboot): the disk tier keeps the salts apart too
    again = store(tiers)
    assert again.find(tokens + (1,), reuse_salt("key:" + "c" * 16, None, ())) == (None, 0)
    found, _ = again.find(tokens + (1,), SB)
    assert found is not None and found.salt == SB and again.load(found) is not None
    again.close()


def worker(name: str, prompts: dict[int, tuple[bytes, str]]) -> WorkerEntry:
    return WorkerEntry(name.encode(), None, "m", -1, 1, pid=1, prompts=prompts)


DOCUMENT = "The offer closes on 12 March at 41 dollars per share. " * 40


def test_routing_matches_a_slots_last_prompt_under_the_same_salt_only() -> None:
    workers = {w.identity: w for w in (worker("a", {0: (SA, DOCUMENT)}), worker("b", {}))}
    free = [(b"b", 0), (b"a", 0)]
    prompt = DOCUMENT + " Summarize."
    assert choose_slots(free, workers, prompt, 1, salt=SA).source is Source.KV  # type: ignore[union-attr]
    route = choose_slots(free, workers, prompt, 1, salt=SB)
    assert route is not None and route.source is Source.LOAD and route.slots == [(b"b", 0)]


def test_routing_by_the_host_store_matches_block_hashes_of_the_same_salt_only() -> None:
    assert block_hashes(DOCUMENT) != block_hashes(DOCUMENT, SA) != block_hashes(DOCUMENT, SB)
    a, b = worker("a", {}), worker("b", {})
    a.ram.apply(wire.CacheChanges(((1, wire.pack_hashes(block_hashes(DOCUMENT[:3 * PREFIX_BLOCK], SA))),)))
    workers = {w.identity: w for w in (a, b)}
    prompt = DOCUMENT + " Summarize."
    free = [(b"b", 0), (b"a", 0)]
    route = choose_slots(free, workers, prompt, 1, blocks=block_hashes(prompt, SA), salt=SA)
    assert route is not None and route.source is Source.RAM and route.slots == [(b"a", 0)]
    route = choose_slots(free, workers, prompt, 1, blocks=block_hashes(prompt, SB), salt=SB)
    assert route is not None and route.source is Source.LOAD and route.slots == [(b"b", 0)]
