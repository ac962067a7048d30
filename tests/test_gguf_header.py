"""The GGUF header reader against gguf's own reader (the built-in models, a written file with every value
type), and against llama.cpp's reading of the real model's metadata when it is installed (gguf's reader takes
tens of seconds over a real vocabulary's arrays, llama.cpp's vocabulary-only load one or two)."""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import RealModel, ServerProcess
from helpers import gguf_with_array

from mpserve.gpu.placement import estimate_model_memory
from mpserve.models import templates
from mpserve.models.builtin import builtin_model_path
from mpserve.models.gguf_header import BLOCKS, read_header
from mpserve.models.maker import vocabulary


def gguf_reader_view(path: str | Path) -> tuple[dict[str, object], list[tuple[str, tuple[int, ...], int, int]]]:
    """What gguf.GGUFReader reads: metadata without string arrays, and each tensor's name, shape (as stored:
    innermost first), type and bytes."""
    reader = gguf.GGUFReader(path)
    metadata: dict[str, object] = {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF."):
            continue  # the reader's own entries for the file header
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
            continue
        metadata[field.name] = field.contents()
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.n_bytes)) for t in reader.tensors]
    return metadata, tensors


def every_key(key: str) -> bool:
    return True


def header_view(path: str | Path) -> tuple[dict[str, object], list[tuple[str, tuple[int, ...], int, int]]]:
    """What ``read_header`` reads, keeping every key, less the string arrays (as ``gguf_reader_view``)."""
    header = read_header(path, every_key)
    metadata = {k: v for k, v in header.metadata.items() if not (isinstance(v, list) and isinstance(v[0], str))}
    return metadata, [(t.name, t.shape, int(t.type), t.n_bytes) for t in header.tensors]


@pytest.mark.parametrize("name", ["tiny", "bench"])
def test_the_built_in_models_read_as_gguf_reads_them(name: str) -> None:
    path = builtin_model_path(name)
    assert header_view(path) == gguf_reader_view(path)


def test_every_value_type_and_nested_arrays(tmp_path: Path) -> None:
    path = tmp_path / "kinds.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint8("k.u8", 7)
    writer.add_int16("k.i16", -3)
    writer.add_uint64("k.u64", 1 << 40)
    writer.add_float64("k.f64", 0.25)
    writer.add_bool("k.bool", True)
    writer.add_string("k.str", "grüß")
    writer.add_array("k.ints", [1, 2, 3])
    writer.add_array("k.strings", ["a", "bc", "😀"])
    writer.add_array("k.nested", [[1, 2], [3]])
    writer.add_uint32("k.after", 42)  # read correctly only if everything before was stepped over right
    writer.add_tensor("w", np.zeros((3, 32), np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata, tensors = header_view(path)
    assert {k: v for k, v in metadata.items() if k.startswith("k.")} == {
        "k.u8": 7, "k.i16": -3, "k.u64": 1 << 40, "k.f64": 0.25, "k.bool": True, "k.str": "grüß",
        "k.ints": [1, 2, 3], "k.after": 42}
    assert tensors == [("w", (32, 3), int(gguf.GGMLQuantizationType.F16), 3 * 32 * 2)] == gguf_reader_view(path)[1]
    kept = read_header(path, every_key).metadata
    assert kept["k.strings"] == ["a", "bc", "😀"] and kept["k.after"] == 42 and "k.nested" not in kept
    assert read_header(path, {"k.after"}.__contains__).metadata == {"k.after": 42}


def test_a_models_token_list_is_read_when_asked_for() -> None:
    path = builtin_model_path("tiny")
    tokens = read_header(path, {"tokenizer.ggml.tokens"}.__contains__).metadata["tokenizer.ggml.tokens"]
    assert tokens == [token.piece for token in vocabulary()]
    assert "tokenizer.ggml.tokens" not in read_header(path, lambda key: key != "tokenizer.ggml.tokens").metadata


def test_a_file_that_is_not_gguf_or_is_cut_short_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "text").write_bytes(b"not a model at all")
    whole = builtin_model_path("tiny").read_bytes()
    (tmp_path / "cut").write_bytes(whole[:200])
    for name in ("empty", "text", "cut"):
        with pytest.raises(ValueError):
            read_header(tmp_path / name, every_key)


def as_llama_cpp_writes_it(value: object) -> str:
    """A scalar as llama.cpp's ``llama_model_meta_val_str`` writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:f}"
    return str(value)


@pytest.mark.real
@pytest.mark.timeout(120)
def test_the_real_models_metadata_reads_as_llama_cpp_reads_it(real_model: RealModel) -> None:
    import llama_cpp

    theirs = llama_cpp.Llama(real_model.path, vocab_only=True, verbose=False)
    header = read_header(real_model.path, every_key)
    scalars = {k: as_llama_cpp_writes_it(v) for k, v in header.metadata.items() if not isinstance(v, list)}
    assert scalars == theirs.metadata  # llama.cpp lists no arrays
    arrays = {k: v for k, v in header.metadata.items() if isinstance(v, list) and not isinstance(v[0], str)}
    assert arrays and all(len(v) == theirs.n_vocab() for v in arrays.values())  # the vocabulary's, whole
    assert len(header.tensors) > 0 and all(t.n_bytes > 0 for t in header.tensors)


def test_a_huge_array_in_a_models_metadata_is_stepped_over_never_built(tmp_path: Path) -> None:
    """What the server reads of a model at start (its memory estimate, its chat template's fallback) keeps only
    the keys it needs: a 20 MB file with a 5M-value array costs it no more than the built-in model."""
    path = gguf_with_array(tmp_path / "big.gguf", 5_000_000)
    plain = builtin_model_path("tiny")
    for name, read in (("estimate", lambda p: estimate_model_memory(p, 512, -1)),
                       ("chat template", lambda p: templates._fallback(str(p), ""))):
        peaks = []
        for model in (plain, path):
            templates._fallback.cache_clear()
            tracemalloc.start()
            read(model)
            peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        assert peaks[1] < peaks[0] + (1 << 20), f"{name}: {peaks[1]} bytes at the peak, against {peaks[0]}"
    with pytest.raises(ValueError, match="'x.bigarr' is an array of 5000000 values, more than the 1048576"):
        read_header(path, every_key)  # a kept array is bounded too


def test_counts_that_no_file_could_hold_are_refused_at_once(tmp_path: Path) -> None:
    whole = builtin_model_path("tiny").read_bytes()
    n_tensors, n_kv = struct.unpack_from("<QQ", whole, 8)
    key = struct.pack("<Q", 5) + b"x.big"
    cases = {
        "key/values": whole[:8] + struct.pack("<QQ", n_tensors, 1 << 60) + whole[24:],
        "tensors": whole[:8] + struct.pack("<QQ", 1 << 60, n_kv) + whole[24:],
        "strings": whole[:8] + struct.pack("<QQ", n_tensors, n_kv + 1) + key + struct.pack("<IIQ", 9, 8, 1 << 60)
        + whole[24:],
        "nests arrays too deep": whole[:8] + struct.pack("<QQ", n_tensors, n_kv + 1) + key
        + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 200_000 + whole[24:],  # arrays of one array
    }
    for what, data in cases.items():
        (tmp_path / "m.gguf").write_bytes(data)
        with pytest.raises(ValueError, match=what):
            read_header(tmp_path / "m.gguf", lambda key: key != "x.big")  # stepped over, never built


def peak_rss_kib(pid: int) -> int:
    return int(next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                    if line.startswith("VmHWM:")).split()[1])


@pytest.mark.timeout(120)
def test_a_server_started_with_a_model_that_has_a_huge_array_holds_no_more_than_with_the_plain_model(
        start_server: type[ServerProcess], tmp_path: Path) -> None:
    big = gguf_with_array(tmp_path / "big.gguf", 5_000_000)
    peaks = []
    for model in (str(builtin_model_path("tiny")), str(big)):
        server = start_server("--model", model, "--instances", "1").wait_ready()
        peaks.append(peak_rss_kib(server.proc.pid))  # the broker's own process, at its highest since it began
        server.stop()
    assert peaks[1] < peaks[0] + 32 * 1024, f"peak RSS {peaks[1]} KiB with the array, {peaks[0]} KiB without"


def test_the_block_sizes_are_ggufs_for_every_type_it_knows() -> None:
    """The reader sizes tensors with a table of its own (gguf imports numpy, which a start need not load): the same
    values per block and bytes per block as gguf's, for each type gguf knows."""
    assert {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()} == BLOCKS
