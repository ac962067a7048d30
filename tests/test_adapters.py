"""LoRA adapters in the batched engine, in-process: random adapters that ``mpserve make-model --lora-for`` writes,
checked against llama.cpp's own application of them (``llama_cpp.Llama(lora_path=...)``), on the tiny built-in
model and on Gemma 3 270M; turns by adapter set; cells never reused across sets; bad adapters refused."""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import pytest
from engines import LONG_PROMPT, N_CTX, PROMPTS, adapters_for, copying

from mpserve.engine.adapters import TURN_STEPS
from mpserve.engine.batch import BatchEngine
from mpserve.engine.interface import Completion
from mpserve.engine.settings import EngineSettings
from mpserve.errors import BadRequest, UnknownModel
from mpserve.models.builtin import builtin_model_path
from mpserve.models.lora_file import check_adapter
from mpserve.models.lora_maker import write_lora
from mpserve.models.maker import write_shape
from mpserve.models.shapes import shape_for
from mpserve.wire.protocol import GenerateParams

NAMES = ("a0", "a1", "a2", "a3")
Choice = tuple[str, float] | None  # an adapter and its scale; None: the base model


@pytest.fixture(scope="module")
def tiny(tiny_model_path: str) -> str:
    return tiny_model_path


@pytest.fixture(scope="module")
def tiny_adapters(tiny: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return adapters_for(tiny, tmp_path_factory.mktemp("adapters"), NAMES)


def engine(path: str, adapters: dict[str, str], parallel: int, repack: bool = True) -> BatchEngine:
    return copying(BatchEngine(EngineSettings(path, n_ctx=N_CTX, parallel=parallel, threads=1, n_gpu_layers=0,
                                              flash_attn="on", repack=repack, reuse="exact",
                                              adapters=tuple(adapters.items()))))


def reference(llama: type[llama_cpp.Llama] | object, path: str, adapter: str | None, scale: float, prompt: str,
              max_tokens: int) -> str:
    """llama.cpp's greedy text with the adapter file applied at ``scale`` (none: the base model)."""
    lora = {"lora_path": adapter, "lora_scale": scale} if adapter else {}
    llm = llama(path, n_ctx=N_CTX, n_threads=1, n_threads_batch=1, flash_attn=True, verbose=False,  # type: ignore
                **lora)
    try:
        return str(llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0)["choices"][0]["text"])
    finally:
        llm.close()


def serve(eng: BatchEngine, requests: list[tuple[str, Choice, int]]) -> list[Completion]:
    """Run ``requests`` (prompt, adapter choice, max tokens), each admitted as soon as a slot is free."""
    results: dict[int, Completion] = {}
    pending, by_slot = list(enumerate(requests)), dict[int, int]()
    while pending or eng.active:
        for slot in eng.free_slots():
            if not pending:
                break
            i, (prompt, choice, n) = pending.pop(0)
            eng.admit(slot, prompt, GenerateParams(max_tokens=n, temperature=0.0), lambda text, k: True,
                      adapters=(choice,) if choice else ())
            by_slot[slot] = i
        for slot, completion in eng.step():
            results[by_slot.pop(slot)] = completion
    return [results[i] for i in range(len(requests))]


def test_make_model_lora_for_writes_the_same_bytes_for_the_same_arguments(tiny: str, tmp_path: Path) -> None:
    run = [sys.executable, "-m", "mpserve", "make-model"]
    for name, seed in (("one", "3"), ("two", "3"), ("other", "4")):
        subprocess.run([*run, str(tmp_path / f"{name}.gguf"), "--lora-for", tiny, "--seed", seed, "--rank", "4"],
                       check=True, capture_output=True)
    one = (tmp_path / "one.gguf").read_bytes()
    assert one == (tmp_path / "two.gguf").read_bytes()
    assert one != (tmp_path / "other.gguf").read_bytes()
    info = check_adapter("one", tmp_path / "one.gguf", tiny)
    assert (info.architecture, info.rank, info.alpha, info.tensors) == ("llama", 4, 4.0, 2 * 7)
    refused = subprocess.run([*run, str(tmp_path / "x.gguf"), "--lora-for", str(tmp_path / "one.gguf")],
                             capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    assert "is not a model GGUF; give the GGUF of the model the adapter is for" in refused.stderr


@pytest.mark.timeout(180)
def test_each_adapter_and_the_base_give_llama_cpp_text_alone_and_all_at_once(
        tiny: str, tiny_adapters: dict[str, str]) -> None:
    """Four adapters and the base model, on 1 instance x parallel 4, at once (they take turns by step), and one
    request at a time: each request's text is llama.cpp's own with that adapter at that scale, and an adapter's
    text is not the base model's."""
    choices: list[Choice] = [None, ("a0", 1.0), ("a1", 0.5), ("a2", 1.0), ("a3", -1.5)]
    requests = [(PROMPTS[i % 4], choices[i % 5], 12 + 3 * i) for i in range(10)]
    expected = [reference(llama_cpp.Llama, tiny, tiny_adapters[c[0]] if c else None, c[1] if c else 1.0, p, n)
                for p, c, n in requests]
    together = engine(tiny, tiny_adapters, parallel=4)
    alone = engine(tiny, tiny_adapters, parallel=1)
    try:
        assert [c.text for c in serve(together, requests)] == expected
        assert [c.text for c in serve(alone, requests)] == expected
    finally:
        together.close()
        alone.close()
    base = {p: t for (p, c, _), t in zip(requests, expected, strict=True) if c is None}
    compared = [(t, base[p]) for (p, c, _), t in zip(requests, expected, strict=True) if c is not None and p in base]
    assert compared and all(t[:len(b)] != b[:len(t)] for t, b in compared)


@pytest.mark.timeout(300)
def test_gemma_adapters_give_llama_cpp_text(real_model: object, tmp_path: Path) -> None:
    """Gemma 3 270M (quantized) with two random adapters and the base, at once on parallel 4."""
    path, repack = real_model.path, real_model.repack  # type: ignore[attr-defined]
    adapters = adapters_for(path, tmp_path, NAMES[:2])
    choices: list[Choice] = [None, ("a0", 1.0), ("a1", 0.75)]
    requests = [(prompt, choices[i % 3], 16) for i, prompt in enumerate(["The capital of France is"] * 3 + PROMPTS[:3])]

    def llama(*args: object, **kwargs: object) -> object:
        return real_model.llama(**kwargs)  # type: ignore[attr-defined]  # the weights laid out as the engine has them

    expected = [reference(llama, path, adapters[c[0]] if c else None, c[1] if c else 1.0, p, n)
                for p, c, n in requests]
    eng = engine(path, adapters, parallel=4, repack=repack)
    try:
        assert [c.text for c in serve(eng, requests)] == expected
    finally:
        eng.close()
    assert len(set(expected[:3])) == 3  # one prompt, three texts: each adapter changes greedy output


@pytest.mark.timeout(300)
def test_gemma_sequences_of_one_adapter_running_at_once_give_llama_cpp_text(real_model: object, tmp_path: Path
                                                                            ) -> None:
    """Three prompts under one adapter at once: with ``reuse: exact`` each decodes alone (llama.cpp multiplies the
    adapter's float tensors by two rows or more with other kernels than by one) and gets llama.cpp's lone text."""
    path, repack = real_model.path, real_model.repack  # type: ignore[attr-defined]
    adapter = adapters_for(path, tmp_path, NAMES[:1])

    def llama(*args: object, **kwargs: object) -> object:
        return real_model.llama(**kwargs)  # type: ignore[attr-defined]

    requests: list[tuple[str, Choice, int]] = [(prompt, ("a0", 1.0), 12) for prompt in PROMPTS[:3]]
    expected = [reference(llama, path, adapter["a0"], 1.0, p, n) for p, _, n in requests]
    eng = engine(path, adapter, parallel=3, repack=repack)
    try:
        assert [c.text for c in serve(eng, requests)] == expected
    finally:
        eng.close()


def test_cells_computed_under_one_adapter_are_never_reused_under_another(
        tiny: str, tiny_adapters: dict[str, str]) -> None:
    """A long prompt computed under a0 leaves whole chunks in its slot; the same prompt under a1 (its own slot, or
    another slot copying them) starts from nothing, while a0 again and a0 elsewhere start from them."""
    eng = engine(tiny, tiny_adapters, parallel=2)
    greedy = GenerateParams(max_tokens=8, temperature=0.0)

    def run(slot: int, choice: tuple[str, float] | None, hold: int | None = None) -> Completion:
        eng.admit(slot, LONG_PROMPT, greedy, lambda text, k: True, adapters=(choice,) if choice else ())
        while True:
            done = dict(eng.step())
            if slot in done:
                return done[slot]

    try:
        first = run(0, ("a0", 1.0))
        assert first.reused_tokens == 0
        assert run(1, ("a1", 1.0)).reused_tokens == 0  # another slot's cells, another adapter: not copied
        assert run(0, ("a0", 0.5)).reused_tokens == 0  # the same adapter at another scale is another set
        assert run(1, None).reused_tokens == 0  # nor the base model
        again = run(0, ("a0", 0.5))
        assert again.reused_tokens == 512
        assert run(1, ("a0", 0.5)).reused_tokens == 512  # copied from slot 0: the same set
        assert run(1, ("a1", 1.0)).reused_tokens == 0
    finally:
        eng.close()


def test_one_prompt_under_several_sets_at_once_is_computed_under_each(
        tiny: str, tiny_adapters: dict[str, str]) -> None:
    """Equal prompts admitted together share one computation (``twins``) only under the same adapters."""
    choices: list[Choice] = [("a0", 1.0), ("a1", 1.0), None, ("a0", 1.0)]
    requests = [(PROMPTS[1], choice, 10) for choice in choices]
    expected = [reference(llama_cpp.Llama, tiny, tiny_adapters[c[0]] if c else None, 1.0, p, n) for p, c, n in requests]
    eng = engine(tiny, tiny_adapters, parallel=4)
    try:
        done = serve(eng, requests)
    finally:
        eng.close()
    assert [c.text for c in done] == expected and len(set(expected)) == 3
    assert [c.reused_tokens for c in done[:3]] == [0, 0, 0] and done[3].reused_tokens == done[3].prompt_tokens


def test_sets_take_turns_of_several_steps(tiny: str, tiny_adapters: dict[str, str]) -> None:
    """Two sequences of a0 decode together; the base and a1 wait their turn: TURN_STEPS steps each (each switch
    rebuilds llama.cpp's compute graphs), round robin."""
    eng = engine(tiny, tiny_adapters, parallel=4)
    steps: dict[int, list[int]] = {}
    clock = [0]

    def note(slot: int) -> Callable[[str, int], bool]:
        def on_token(text: str, k: int) -> bool:
            steps.setdefault(slot, []).append(clock[0])
            return True
        return on_token

    try:
        for slot, choice in enumerate([("a0", 1.0), ("a0", 1.0), None, ("a1", 1.0)]):
            eng.admit(slot, PROMPTS[slot], GenerateParams(max_tokens=6, temperature=0.0), note(slot),
                      adapters=(choice,) if choice else ())
        while eng.active:
            eng.step()
            clock[0] += 1
    finally:
        eng.close()
    assert steps[0] == steps[1]  # one set: one decode
    assert len({s for seq in steps.values() for s in seq}) == 3 * 6  # three sets, never two in one step
    firsts = {slot: steps[slot][0] for slot in (0, 2, 3)}
    assert sorted(firsts.values()) == [0, TURN_STEPS, 2 * TURN_STEPS]  # a turn each, round robin
    for slot, first in firsts.items():  # a turn: TURN_STEPS steps in a row, a token each
        assert steps[slot][:TURN_STEPS] == list(range(first, first + TURN_STEPS))


def test_bad_adapters_are_refused_with_what_to_give_instead(tiny: str, tiny_adapters: dict[str, str],
                                                            tmp_path: Path) -> None:
    narrow = tmp_path / "narrow.gguf"
    write_shape(narrow, "narrow", shape_for("tiny").__class__(**{**shape_for("tiny").__dict__, "n_ff": 96}))
    rerank = builtin_model_path("tiny-rerank")
    eng = engine(tiny, {"a0": tiny_adapters["a0"]}, parallel=2)
    try:
        cases = {
            tiny: "is a model GGUF, not a LoRA adapter; give a LoRA adapter GGUF",
            str(write_lora(tmp_path / "rerank.gguf", rerank)): "adapts a 'qwen3' model, and this model is 'llama': "
                                                               "give an adapter made for this model",
            str(write_lora(tmp_path / "narrow-lora.gguf", narrow)): "the adapter was made for another model of this "
                                                                    "architecture; give one made for this model",
            str(tmp_path / "missing.gguf"): "no such file; give the path of a LoRA adapter GGUF",
        }
        for path, words in cases.items():
            with pytest.raises(BadRequest, match="] adapter 'x' ") as refused:
                eng.load_adapter("x", path)
            assert words in refused.value.message and "\n" not in refused.value.message
        assert eng.adapter_names() == ("a0",)
        with pytest.raises(UnknownModel, match=r"no adapter 'a9' is loaded for this model \(adapters served: a0\)"):
            eng.admit(0, "Hello", GenerateParams(), lambda text, k: True, adapters=(("a9", 1.0),))
        with pytest.raises(BadRequest, match="is loaded already"):
            eng.load_adapter("a0", tiny_adapters["a1"])
        eng.admit(0, "Hello", GenerateParams(max_tokens=4), lambda text, k: True, adapters=(("a0", 1.0),))
        with pytest.raises(BadRequest, match="in use by 1 running request"):
            eng.unload_adapter("a0")
        while eng.active:
            eng.step()
        with pytest.raises(BadRequest, match="computed under LoRA adapters"):
            eng.save_slot(0, tmp_path / "slot.bin")
        eng.unload_adapter("a0")
        eng.load_adapter("b", tiny_adapters["a1"])
        assert eng.adapter_names() == ("b",)
    finally:
        eng.close()


HEAP_PROBE = """
import ctypes, sys
from mpserve.engine.batch import BatchEngine
from mpserve.engine.settings import EngineSettings
from mpserve.wire.protocol import GenerateParams
eng = BatchEngine(EngineSettings(sys.argv[1], n_ctx=256, parallel=1, threads=1, n_gpu_layers=0,
                                 adapters=(("a0", sys.argv[2]),)))
eng.admit(0, "Hello", GenerateParams(max_tokens=2), lambda text, k: True, adapters=(("a0", 1.0),))
while eng.active:
    eng.step()
eng.close()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = MallInfo2
libc.free(libc.malloc(8 << 20))  # as llama.cpp frees a compute buffer when it reserves anew
kept = libc.mallinfo2().fordblks  # the heap's free chunks: what the process keeps of what was freed there
block = libc.malloc(kept + (256 << 10))  # more than they hold: served by a new mapping, or by the heap grown
heap = [line.split()[0].split("-") for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]")]
print(kept, any(int(start, 16) <= block < int(end, 16) for start, end in heap))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or "glibc" not in " ".join(platform.libc_ver()),
                    reason="glibc's malloc")
def test_an_engine_that_changed_adapters_gives_freed_large_blocks_back(tiny: str, tiny_adapters: dict[str, str]
                                                                        ) -> None:
    """llama.cpp frees and allocates its buffers at each change of adapters; glibc would then serve blocks that size
    from the heap, which the process keeps (an instance's private memory grew with each set it ran). Once the engine
    has run a request under an adapter, the heap keeps little of what was freed, and a block larger than its free
    chunks, allocated after a larger one was freed, gets a mapping of its own. (The free chunks are measured, not
    assumed: a block that fits in one comes from the heap whatever the threshold.)"""
    probe = subprocess.run([sys.executable, "-c", HEAP_PROBE, tiny, tiny_adapters["a0"]], capture_output=True,
                           text=True, timeout=60)
    assert probe.returncode == 0, probe.stderr[-2000:]
    kept, in_heap = probe.stdout.split()[-2:]
    assert int(kept) < 8 << 20, f"the heap keeps {int(kept)} bytes that llama.cpp freed"
    assert in_heap == "False", "a block of the size the threshold should map came from the heap"
