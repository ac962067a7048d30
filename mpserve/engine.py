"""The compute core: one model context that turns a prompt into tokens. It knows nothing of processes,
sockets or the slot table; the worker wraps it.

``LlamaEngine`` drives ``llama_cpp.Llama.create_completion`` exactly as a direct in-process caller would,
so greedy output through mpserve equals a direct call. Each generated token passes through
``on_token``, which the worker uses to stream, record progress and check for cancellation.
``EchoEngine`` returns the prompt without a model, so benchmarks can measure the serving path alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from . import chat_template
from .chat_template import ChatTemplate
from .errors import BadRequest
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


class Engine(Protocol):
    chat: ChatTemplate  # the model's chat template, for the broker to hand to the HTTP gateway

    def generate(self, prompt: str, params: GenerateParams, on_token: OnToken) -> Completion: ...

    def close(self) -> None:
        """Free the model and its context (the idle watchdog unloads this way)."""


@dataclass(frozen=True)
class EngineSpec:
    """What a worker needs to build its engine. ``path`` "echo" selects the echo backend."""

    path: str
    n_ctx: int  # per sequence
    threads: int
    n_gpu_layers: int
    seed: int = 0
    parallel: int = 1  # > 1: a BatchEngine decoding this many sequences together
    flash_attn: str = "auto"  # auto, on or off

    @property
    def is_echo(self) -> bool:
        return self.path == "echo"


def load_engine(spec: EngineSpec) -> Engine:
    """Build the engine. Imports llama_cpp only here, after the worker has set CUDA_VISIBLE_DEVICES."""
    if spec.is_echo:
        return EchoEngine()
    return LlamaEngine(spec)


class LlamaEngine:
    def __init__(self, spec: EngineSpec) -> None:
        import llama_cpp

        self._criteria = llama_cpp.StoppingCriteriaList
        self._llm = llama_cpp.Llama(
            model_path=spec.path, n_ctx=spec.n_ctx, n_threads=spec.threads, n_threads_batch=spec.threads,
            n_gpu_layers=spec.n_gpu_layers, seed=spec.seed, flash_attn=spec.flash_attn != "off", verbose=False,
        )  # llama_cpp.Llama has on and off only: auto is on, which llama.cpp's own auto picks on CPUs and CUDA
        self.chat = chat_template.read(llama_cpp, self._llm.model)
        # llama.cpp sets up its compute graphs and thread pool on the first decode (~150 ms here); do it
        # while loading, so the first request does not pay for it.
        self._llm.create_completion("warm up", max_tokens=2, temperature=0)

    def close(self) -> None:
        self._llm.close()

    def generate(self, prompt: str, params: GenerateParams, on_token: OnToken) -> Completion:
        counter = _TokenCounter(on_token)
        started = time.perf_counter()
        try:
            stream = self._llm.create_completion(
                prompt, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, seed=params.seed, stop=list(params.stop),
                repeat_penalty=params.repeat_penalty, stream=True, stopping_criteria=self._criteria([counter]),
            )
            pieces: list[str] = []
            finish_reason = "length"
            for chunk in stream:
                choice = chunk["choices"][0]
                if choice["text"]:
                    pieces.append(choice["text"])
                    if not counter.forward(choice["text"]):
                        counter.cancelled = True
                if choice["finish_reason"]:
                    finish_reason = choice["finish_reason"]
                if counter.cancelled:
                    break
        except ValueError as exc:  # llama-cpp-python's way of saying the prompt does not fit
            raise BadRequest(str(exc)) from None
        ended = time.perf_counter()
        first = counter.first_token_at or ended
        return Completion(
            text="".join(pieces), finish_reason="cancelled" if counter.cancelled else finish_reason,
            prompt_tokens=counter.prompt_tokens, completion_tokens=counter.generated,
            prompt_s=first - started, generate_s=ended - first,
        )


class _TokenCounter:
    """A llama.cpp stopping criterion that counts sampled tokens and stops on cancellation.

    llama-cpp-python calls it once per sampled token with the ids evaluated so far (prompt + previous
    tokens), and once more after the loop with the same length as the last call; counting distinct
    lengths gives the number of sampled tokens.
    """

    def __init__(self, on_token: OnToken) -> None:
        self._on_token = on_token
        self.prompt_tokens = 0
        self.generated = 0
        self.first_token_at: float | None = None
        self.cancelled = False
        self._last_len = -1

    def __call__(self, input_ids: Any, logits: Any) -> bool:
        n = len(input_ids)
        if n != self._last_len:
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
                self.prompt_tokens = n
            self._last_len = n
            self.generated = n - self.prompt_tokens + 1
        return self.cancelled

    def forward(self, text: str) -> bool:
        return self._on_token(text, self.generated)


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
