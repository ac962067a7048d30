"""A model file loaded into llama.cpp (``load_model``, for every engine and a draft model; ``free`` with its
context at the end), and what a worker
reports about the model it loaded: its chat template and the token texts templates use.

    GGUF file --load_model--> llama.cpp model --read_chat_template--> ChatTemplate --READY--> broker --STATS-->
    gateway (renders it)
"""

from __future__ import annotations

import ctypes
from typing import Any

from mpserve.wire.protocol import ChatTemplate

from .llama_log import install as install_log


def load_model(lib: Any, path: str, n_gpu_layers: int, repack: bool) -> Any:
    """The llama.cpp model in ``path``, ``n_gpu_layers`` of its layers on the GPU (-1: all); ``repack``:
    llama.cpp's repacked weight layouts for this CPU. ValueError, in ``llama_cpp.Llama``'s words, if it
    cannot be loaded (the log has llama.cpp's reason: ``mpserve.engine.llama_log``)."""
    install_log(lib)
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers
    params.use_extra_bufts = repack  # llama_cpp.Llama keeps llama.cpp's default: on
    model = lib.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ValueError(f"Failed to load model from file: {path}")
    return model


def free(lib: Any, ctx: Any, model: Any) -> None:
    """Free a context, then a model (either may be None: never made, already freed, or not this owner's)."""
    if ctx:
        lib.llama_free(ctx)
    if model:
        lib.llama_model_free(model)


FLOAT_FILE_TYPES = frozenset({0, 1, 32})
"""llama.cpp's ``llama_ftype`` of weights kept as floats (ALL_F32, MOSTLY_F16, MOSTLY_BF16): none that its CPU
backend repacks."""


def float_weights(lib: Any, model: Any) -> bool:
    """Whether a loaded model's weights are floats (its GGUF's ``general.file_type``); a file that does not say is
    taken as quantized."""
    value = ctypes.create_string_buffer(32)
    if lib.llama_model_meta_val_str(model, b"general.file_type", value, len(value)) < 0:
        return False
    return value.value.isdigit() and int(value.value) in FLOAT_FILE_TYPES


def read_chat_template(lib: Any, model: Any, template: str | None = None) -> ChatTemplate:
    """The chat template of a loaded llama.cpp model (``lib`` is the llama_cpp module): ``template`` when given
    (the one chosen for it, ``mpserve.models.templates``; "" the ChatML default), else the GGUF's."""
    source = lib.llama_model_chat_template(model, None) if template is None else template.encode()
    vocab = lib.llama_model_get_vocab(model)

    def text(token: int) -> str:
        return lib.llama_vocab_get_text(vocab, token).decode("utf-8", errors="replace") if token >= 0 else ""

    return ChatTemplate(source.decode("utf-8", errors="replace") if source else "",
                        text(lib.llama_vocab_bos(vocab)), text(lib.llama_vocab_eos(vocab)))
