"""What the compute cores share: the spec a worker builds its engine from, a completion, the per-token
callback; and ``EchoEngine``, the backend without a model.

Models are served by ``mpserve.batch.BatchEngine``, with ``parallel`` sequences (1 by default), whose
greedy output equals ``llama_cpp.Llama.create_completion``. ``EchoEngine`` returns the prompt without a
model, one request at a time, so benchmarks can measure the serving path alone. Each generated piece of
text passes through ``on_token``, which the worker uses to stream, record progress and check for
cancellation. Engines know nothing of processes, sockets or the slot table; the worker wraps them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .chat_template import ChatTemplate
from .protocol import GenerateParams

OnToken = Callable[[str, int], bool]
"""Called with each new piece of text and the number of tokens generated so far; returns False to stop
generating (cancellation)."""


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str  # "length" | "stop" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    prompt_s: float
    generate_s: float


@dataclass(frozen=True)
class EngineSpec:
    """What a worker needs to build its engine. ``path`` "echo" selects the echo backend."""

    path: str
    n_ctx: int  # per sequence
    threads: int
    n_gpu_layers: int
    seed: int = 0
    parallel: int = 1  # sequences the BatchEngine decodes together
    flash_attn: str = "auto"  # auto, on or off
    repack: bool = True  # llama.cpp's extra (repacked) weight buffer types

    @property
    def is_echo(self) -> bool:
        return self.path == "echo"


class EchoEngine:
    """Returns the prompt as ``max_tokens`` chunks of about equal size. No model, no compute."""

    chat = ChatTemplate()

    def close(self) -> None:
        pass

    def generate(self, prompt: str, params: GenerateParams, on_token: OnToken) -> Completion:
        started = time.perf_counter()
        n = max(1, min(params.max_tokens, len(prompt)))
        size = -(-len(prompt) // n) if prompt else 1
        sent: list[str] = []
        for i in range(n):
            sent.append(prompt[i * size:(i + 1) * size])
            if not on_token(sent[-1], i + 1):
                break
        ended = time.perf_counter()
        return Completion(
            text="".join(sent), finish_reason="cancelled" if len(sent) < n else "length",
            prompt_tokens=len(prompt), completion_tokens=len(sent), prompt_s=0.0, generate_s=ended - started,
        )
