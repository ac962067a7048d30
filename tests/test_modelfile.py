"""The generated GGUF models: deterministic, small, loadable by llama.cpp, and clean in what they emit."""

from __future__ import annotations

import hashlib
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import gguf
import llama_cpp
import numpy as np
import pytest

from mpserve.errors import BadRequest
from mpserve.models.builtin import default_model_path
from mpserve.models.maker import vocabulary, write_model
from mpserve.models.shapes import MODEL_SIZES

PROMPTS = ["Hello", "The quick brown fox", "In the beginning", "x", "1 2 3 4"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[llama_cpp.Llama]:
    path = write_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "tiny")
    llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False, n_threads=1, seed=7)
    yield llm
    llm.close()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.timeout(30)
def test_same_arguments_write_identical_bytes(tmp_path: Path) -> None:
    first = write_model(tmp_path / "a.gguf", "tiny")
    second = write_model(tmp_path / "b.gguf", "tiny")
    assert sha256(first) == sha256(second)


@pytest.mark.timeout(30)
def test_write_leaves_only_the_model_file(tmp_path: Path) -> None:
    path = write_model(tmp_path / "tiny.gguf")
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.timeout(60)
def test_concurrent_writers_of_one_path_leave_one_complete_file(tmp_path: Path) -> None:
    reference = write_model(tmp_path / "reference.gguf", "tiny")
    target = tmp_path / "racing" / "tiny.gguf"
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        pool.map(write_model, [target] * 8)
    assert sha256(target) == sha256(reference)
    assert list(target.parent.iterdir()) == [target]


@pytest.mark.timeout(30)
def test_tiny_model_is_under_one_megabyte(tmp_path: Path) -> None:
    assert write_model(tmp_path / "tiny.gguf", "tiny").stat().st_size < 1_000_000


@pytest.mark.timeout(30)
def test_unknown_size_raises_bad_request_naming_the_allowed_sizes(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="bench.*tiny"):
        write_model(tmp_path / "huge.gguf", "huge")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(10)
def test_bench_shape_has_about_85m_parameters() -> None:
    assert 80_000_000 <= MODEL_SIZES["bench"].parameter_count(len(vocabulary())) <= 90_000_000


@pytest.mark.timeout(30)
def test_file_metadata_describes_the_model(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_model(tmp_path / "tiny.gguf", "tiny"))
    name = reader.fields["general.name"]
    assert bytes(name.parts[name.data[0]]).decode() == "mpserve-tiny"
    weights = sum(int(tensor.n_elements) for tensor in reader.tensors)
    assert weights == MODEL_SIZES["tiny"].parameter_count(len(vocabulary()))


@pytest.mark.timeout(30)
def test_the_draft_model_is_the_tiny_model_cut_to_its_first_block(tmp_path: Path) -> None:
    tiny = {t.name: t for t in gguf.GGUFReader(write_model(tmp_path / "tiny.gguf", "tiny")).tensors}
    draft = {t.name: t for t in gguf.GGUFReader(write_model(tmp_path / "draft.gguf", "tiny-draft")).tensors}
    assert set(draft) == {name for name in tiny if not name.startswith("blk.1.")}
    assert all(np.array_equal(draft[name].data, tiny[name].data) for name in draft)
    assert sum(int(t.n_elements) for t in draft.values()) == MODEL_SIZES["tiny-draft"].parameter_count(
        len(vocabulary()))


@pytest.mark.timeout(60)
def test_greedy_generation_runs_to_max_tokens_in_printable_ascii(tiny_llama: llama_cpp.Llama) -> None:
    for prompt in PROMPTS:
        result = tiny_llama(prompt, max_tokens=32, temperature=0.0)
        choice = result["choices"][0]
        assert result["usage"]["completion_tokens"] == 32
        assert choice["finish_reason"] == "length"
        assert choice["text"] and all(" " <= char <= "~" for char in choice["text"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_only_emits_printable_pieces(tiny_llama: llama_cpp.Llama, temperature: float) -> None:
    printable = {i for i, token in enumerate(vocabulary()) if token.kind == gguf.TokenType.NORMAL}
    for prompt in PROMPTS:
        generated = []
        sampled = tiny_llama.generate(
            tiny_llama.tokenize(prompt.encode()), temp=temperature, top_k=0, top_p=1.0, min_p=0.0
        )
        for token in sampled:
            generated.append(token)
            if len(generated) == 200:
                break
        assert set(generated) <= printable


@pytest.mark.timeout(30)
def test_tokenize_detokenize_round_trips_ascii(tiny_llama: llama_cpp.Llama) -> None:
    text = "The quick brown fox jumps over the lazy dog. 0123456789 ~!@#$%^&*()_+{}|:\"<>?"
    tokens = tiny_llama.tokenize(text.encode())
    assert tokens[0] == tiny_llama.token_bos()
    assert len(tokens) < len(text)  # the common pieces are used
    assert tiny_llama.detokenize(tokens).decode() == text


@pytest.mark.timeout(30)
def test_default_model_is_written_once_into_the_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = default_model_path()
    assert path.parent == tmp_path / "cache"
    assert path.name.startswith("mpserve-tiny-v") and path.suffix == ".gguf"
    first_mtime = path.stat().st_mtime_ns
    assert default_model_path() == path
    assert path.stat().st_mtime_ns == first_mtime
