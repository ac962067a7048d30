"""Memory estimates read from a real (tiny) GGUF, and placement plans over simulated devices."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from mpserve.errors import ConfigError, ModelDoesNotFit
from mpserve.gpu.devices import Device, format_memory, parse_simulated
from mpserve.gpu.placement import (
    OVERHEAD,
    MemoryEstimate,
    ModelRequest,
    Placement,
    check_kv_types,
    estimate_model_memory,
    estimate_request,
    format_plan,
    place_one,
    plan,
)

GIB = 1 << 30
N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, N_VOCAB = 4, 64, 4, 2, 100
HEAD_DIM = N_EMBD // N_HEAD
F32 = 4
BLOCK_BYTES = (N_EMBD * N_EMBD + 2 * N_HEAD_KV * HEAD_DIM * N_EMBD + N_EMBD) * F32
OUTPUT_BYTES = (N_VOCAB * N_EMBD + N_EMBD) * F32  # output.weight + output_norm.weight
EMBEDDING_BYTES = N_VOCAB * N_EMBD * F32


def write_llama_gguf(path: Path, *, tied_embeddings: bool = False) -> Path:
    """A llama-shaped GGUF with zero weights: enough metadata and tensors for the estimate."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(N_LAYER)
    writer.add_context_length(2048)
    writer.add_embedding_length(N_EMBD)
    writer.add_feed_forward_length(4 * N_EMBD)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_tensor("token_embd.weight", np.zeros((N_VOCAB, N_EMBD), np.float32))
    for layer in range(N_LAYER):
        writer.add_tensor(f"blk.{layer}.attn_q.weight", np.zeros((N_EMBD, N_EMBD), np.float32))
        writer.add_tensor(f"blk.{layer}.attn_k.weight", np.zeros((N_HEAD_KV * HEAD_DIM, N_EMBD), np.float32))
        writer.add_tensor(f"blk.{layer}.attn_v.weight", np.zeros((N_HEAD_KV * HEAD_DIM, N_EMBD), np.float32))
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(N_EMBD, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(N_EMBD, np.float32))
    if not tied_embeddings:
        writer.add_tensor("output.weight", np.zeros((N_VOCAB, N_EMBD), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def kv_bytes(layers: int, n_ctx: int, parallel: int) -> int:
    return 2 * layers * n_ctx * parallel * N_HEAD_KV * HEAD_DIM * 2


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def request(name: str = "llama", memory: int | None = GIB, **changes: object) -> ModelRequest:
    fields: dict[str, object] = dict(
        name=name, path="unused.gguf", instances=1, n_ctx=4096, n_gpu_layers=-1, parallel=1, devices=None
    )
    fields.update(changes)
    return ModelRequest(memory=memory, **fields)  # type: ignore[arg-type]


def gpus(*free_gib: float) -> list[Device]:
    return [Device(i, "Test GPU", f"GPU-{i}", int(80 * GIB), int(free * GIB)) for i, free in enumerate(free_gib)]


@pytest.mark.timeout(10)
def test_full_offload_counts_every_block_the_output_layer_and_the_kv_cache(model_path: Path) -> None:
    estimate = estimate_model_memory(model_path, n_ctx=512, n_gpu_layers=-1, parallel=2)
    assert estimate == MemoryEstimate(N_LAYER * BLOCK_BYTES + OUTPUT_BYTES, kv_bytes(N_LAYER, 512, 2), OVERHEAD)
    assert estimate.total == estimate.weights + estimate.kv_cache + OVERHEAD
    assert estimate_model_memory(model_path, 512, N_LAYER + 10, 2) == estimate


@pytest.mark.timeout(10)
def test_partial_offload_counts_only_the_offloaded_blocks(model_path: Path) -> None:
    estimate = estimate_model_memory(model_path, n_ctx=1024, n_gpu_layers=2)
    assert (estimate.weights, estimate.kv_cache) == (2 * BLOCK_BYTES, kv_bytes(2, 1024, 1))
    assert estimate_model_memory(model_path, 1024, 0) == MemoryEstimate(0, 0, OVERHEAD)


@pytest.mark.timeout(10)
def test_the_kv_cache_counts_each_types_bytes_per_element_and_every_parallel_sequence(model_path: Path) -> None:
    cells = N_LAYER * 512 * 3 * N_HEAD_KV * HEAD_DIM  # K (or V) elements of 3 sequences of 512 cells
    for k, v, per_element in (("f16", "f16", 2 + 2), ("f32", "bf16", 4 + 2), ("q8_0", "q4_0", (34 + 18) / 32),
                              ("q4_1", "iq4_nl", (20 + 18) / 32), ("q5_0", "q5_1", (22 + 24) / 32)):
        assert estimate_model_memory(model_path, 512, -1, 3, k, v).kv_cache == int(cells * per_element), (k, v)
    assert estimate_model_memory(model_path, 512, -1, 3).kv_cache == kv_bytes(N_LAYER, 512, 3)
    quantized = request(memory=None, path=str(model_path), n_ctx=512, parallel=3, cache_type_k="q8_0",
                        cache_type_v="q8_0")
    [placement] = plan([quantized], parse_simulated("1GiB"))
    assert placement.memory == estimate_model_memory(model_path, 512, -1, 3, "q8_0", "q8_0").total


@pytest.mark.timeout(10)
def test_a_quantized_kv_type_whose_blocks_do_not_divide_the_heads_is_a_config_error(model_path: Path) -> None:
    check_kv_types("llama", model_path, "f16", "bf16")  # unblocked types fit any head
    with pytest.raises(ConfigError, match=r"model 'llama': cache_type_k q8_0 stores blocks of 32 elements, and "
                                          r"this model's K heads have 16; use f16, bf16 or f32"):
        check_kv_types("llama", model_path, "q8_0", "f16")
    with pytest.raises(ConfigError, match="cache_type_v q4_0 .* V heads have 16"):
        check_kv_types("llama", model_path, "f16", "q4_0")


@pytest.mark.timeout(10)
def test_tied_embeddings_count_as_the_output_layer(tmp_path: Path) -> None:
    path = write_llama_gguf(tmp_path / "tied.gguf", tied_embeddings=True)
    estimate = estimate_model_memory(path, n_ctx=256, n_gpu_layers=-1)
    assert estimate.weights == N_LAYER * BLOCK_BYTES + EMBEDDING_BYTES + N_EMBD * F32


@pytest.mark.timeout(10)
def test_a_file_that_is_not_gguf_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ConfigError, match="not.gguf"):
        estimate_model_memory(path, 512, -1)


@pytest.mark.timeout(10)
def test_instances_go_round_robin_across_models_and_devices() -> None:
    placements = plan([request("a", instances=3), request("b")], gpus(40, 40))
    assert [(p.model, p.instance, p.device) for p in placements] == [
        ("a", 0, 0),
        ("a", 1, 1),
        ("a", 2, 0),
        ("b", 0, 1),
    ]
    assert {p.memory for p in placements} == {GIB}


@pytest.mark.timeout(10)
def test_pinned_models_stay_on_their_devices() -> None:
    placements = plan([request("a", instances=3, devices=(1, 2)), request("b", devices=(0,))], gpus(40, 40, 40))
    assert [p.device for p in placements] == [1, 2, 1, 0]


@pytest.mark.timeout(10)
def test_an_instance_skips_a_full_device() -> None:
    placements = plan([request("a", instances=3, memory=10 * GIB)], gpus(15, 40))
    assert [p.device for p in placements] == [0, 1, 1]


@pytest.mark.timeout(10)
def test_the_budget_caps_each_device_below_its_free_memory() -> None:
    assert [p.device for p in plan([request(instances=2, memory=6 * GIB)], gpus(40, 40), budget=8 * GIB)] == [0, 1]
    with pytest.raises(ModelDoesNotFit, match=r"8\.0 GiB budget"):
        plan([request(instances=3, memory=6 * GIB)], gpus(40, 40), budget=8 * GIB)


@pytest.mark.timeout(10)
def test_a_model_that_fits_nowhere_names_model_device_need_room_and_a_hint() -> None:
    def estimate(*args: object) -> MemoryEstimate:
        return MemoryEstimate(int(6.2 * GIB), GIB // 2, GIB // 2)

    big = request("big", instances=2, memory=None, n_ctx=8192, n_gpu_layers=33)
    with pytest.raises(ModelDoesNotFit) as caught:
        plan([big], gpus(10), estimate=estimate)
    error = caught.value
    assert error.code == "does_not_fit"
    for part in ("'big' instance 1", "needs 7.2 GiB", "GPU 0 (Test GPU)", "has 2.8 GiB available", "10.0 GiB free"):
        assert part in error.message
    for hint in ("n_gpu_layers (now 33)", "n_ctx (now 8192)", "another device"):
        assert hint in error.message
    assert "(estimated: weights 6.2 GiB + KV cache 512.0 MiB for parallel 1 × n_ctx 8192 + overhead 512.0 MiB)" \
        in error.message


@pytest.mark.timeout(10)
def test_a_model_whose_kv_cache_does_not_fit_says_parallel_and_n_ctx_first() -> None:
    def estimate(*args: object) -> MemoryEstimate:
        return MemoryEstimate(GIB // 2, 16 * GIB, GIB // 2)

    wide = request("wide", memory=None, n_ctx=8192, parallel=64)
    with pytest.raises(ModelDoesNotFit, match=r"KV cache 16\.0 GiB for parallel 64 × n_ctx 8192 .* try a smaller "
                                              r"parallel \(now 64\) or n_ctx \(now 8192\), fewer n_gpu_layers"):
        plan([wide], gpus(10), estimate=estimate)
    with pytest.raises(ModelDoesNotFit, match="declared requires.memory.*a smaller requires.memory"):
        plan([request("big", memory=11 * GIB)], gpus(10))


@pytest.mark.timeout(10)
def test_without_devices_everything_runs_on_the_cpu_unchecked() -> None:
    huge = request("huge", instances=2, memory=10**15)
    assert plan([huge], []) == [Placement("huge", 0, None, 0), Placement("huge", 1, None, 0)]


@pytest.mark.timeout(10)
def test_declared_memory_overrides_the_estimate() -> None:
    def no_estimate(*args: object) -> MemoryEstimate:
        raise AssertionError("declared memory must not be estimated")

    assert plan([request(memory=3 * GIB)], gpus(40), estimate=no_estimate)[0].memory == 3 * GIB


@pytest.mark.timeout(10)
def test_undeclared_memory_is_estimated_from_the_gguf(model_path: Path) -> None:
    model = request(memory=None, path=str(model_path), n_ctx=512, parallel=2)
    [placement] = plan([model], parse_simulated("1GiB"))
    assert placement.memory == estimate_model_memory(model_path, 512, -1, 2).total


@pytest.mark.timeout(10)
def test_pinning_to_a_missing_device_and_multi_gpu_instances_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="pinned to GPU 4.*has GPU 0, 1"):
        plan([request(devices=(0, 4))], gpus(40, 40))
    with pytest.raises(ConfigError, match="2 GPUs per instance"):
        plan([request(gpus=2)], gpus(40, 40))


@pytest.mark.timeout(10)
def test_format_plan_shows_each_instance_and_each_devices_total() -> None:
    devices = gpus(40, 20)
    text = format_plan(plan([request("a", instances=3, memory=2 * GIB)], devices), devices)
    lines = text.splitlines()
    assert lines[0].split() == ["MODEL", "INSTANCE", "DEVICE", "MEMORY"]
    assert lines[1].split() == ["a", "0", "GPU", "0", "(Test", "GPU)", "2.0", "GiB"]
    assert "GPU 0 (Test GPU): 4.0 GiB planned of 40.0 GiB free" in lines
    assert "GPU 1 (Test GPU): 2.0 GiB planned of 20.0 GiB free" in lines
    assert "CPU" in format_plan(plan([request("a")], []), [])


@pytest.mark.timeout(10)
def test_a_draft_model_adds_its_weights_and_kv_cache_and_the_plan_shows_it(model_path: Path, tmp_path: Path) -> None:
    """The draft's estimate by the same rules (f16 cells), its weights left out when it is the model's own file
    (loaded once); ``mpserve plan`` shows the draft's share of each instance."""
    draft_path = write_llama_gguf(tmp_path / "draft.gguf")
    alone = estimate_model_memory(model_path, 512, -1, 2)
    draft = estimate_model_memory(draft_path, 512, -1, 2)
    base = dict(memory=None, path=str(model_path), n_ctx=512, parallel=2)
    assert estimate_request(request(**base)) == alone
    with_draft = estimate_request(request(**base, draft=str(draft_path)))
    assert with_draft.draft == draft.weights + draft.kv_cache and with_draft.total == alone.total + with_draft.draft
    assert estimate_request(request(**base, draft=str(model_path))).draft == alone.kv_cache
    devices = gpus(40)
    placements = plan([request("a", **base, draft=str(draft_path))], devices)
    assert placements[0].memory == with_draft.total and placements[0].draft == with_draft.draft
    assert f"(draft model {format_memory(with_draft.draft)})" in format_plan(placements, devices).splitlines()[1]
    assert plan([request("a", memory=GIB, draft=str(draft_path))], devices)[0].draft == 0  # declared: all in


@pytest.mark.timeout(10)
def test_one_more_instance_goes_where_most_room_is_left_after_the_running_ones() -> None:
    live = [Placement("a", 0, 0, 6 * GIB), Placement("b", 0, 1, 2 * GIB)]
    assert place_one(request("a", memory=4 * GIB), 1, live, gpus(10, 10)) == Placement("a", 1, 1, 4 * GIB)
    live.append(Placement("a", 1, 1, 4 * GIB))
    with pytest.raises(ModelDoesNotFit, match=r"model 'a' instance 2 needs 5\.0 GiB.*6\.0 GiB planned"):
        place_one(request("a", memory=5 * GIB), 2, live, gpus(10, 10))
    with pytest.raises(ModelDoesNotFit, match=r"budget"):
        place_one(request("a", memory=2 * GIB), 2, live, gpus(10, 10), budget=7 * GIB)
    assert place_one(request("a", memory=2 * GIB, devices=(0,)), 2, live, gpus(10, 10)).device == 0
    assert place_one(request("a"), 3, live, []) == Placement("a", 3, None, 0)


def test_with_single_active_backend_a_device_holds_its_largest_model_not_every_model() -> None:
    devices = gpus(10)
    models = [request("a", instances=2, memory=4 * GIB), request("b", memory=6 * GIB)]
    with pytest.raises(ModelDoesNotFit):  # 14 GiB resident at once
        plan(models, devices)
    placed = plan(models, devices, single_active=True)  # a's 8 GiB or b's 6 GiB, never both
    assert [p.device for p in placed] == [0, 0, 0]
    assert ("GPU 0 (Test GPU): 8.0 GiB planned of 10.0 GiB free (single active backend: the largest of 2 models, "
            "one resident at a time)") in format_plan(placed, devices, single_active=True).splitlines()
    assert place_one(request("b", memory=4 * GIB), 1, placed, devices, single_active=True).device == 0
    with pytest.raises(ModelDoesNotFit):  # b's second instance beside its first: 6 + 6 GiB
        place_one(request("b", memory=6 * GIB), 1, placed, devices, single_active=True)
