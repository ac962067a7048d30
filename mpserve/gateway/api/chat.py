"""Chat templates: the one a GGUF carries (``tokenizer.chat_template``, Jinja2), read where the model is
loaded (``mpserve.engine.model_info``) and rendered here, where chat requests arrive.

A worker reads its model's template, with the BOS and EOS token texts templates refer to, and sends them in
READY; the broker keeps them per model and hands them out in STATS; the HTTP gateway renders a chat
request's messages with them (``render``), as Hugging Face's tokenizers and llama-cpp-python do: a
sandboxed Jinja2 environment, ``messages`` as role/content mappings, ``add_generation_prompt`` true. The
engines add BOS themselves when they tokenize a prompt, so templates get an empty ``bos_token``: a
template that starts with it would otherwise give the model two.

A template is code a model file brings, so it renders within a budget (``TemplateBudget``), off the event
loop (``Renderer``: a few threads of its own), so that a slow one never holds up other requests or
``/health``:

    Renderer.render ──thread──▶ render: the template compiled once into _BudgetedSandbox, its tree rewritten
        so that every {% for %} steps through ``step`` (the deadline checked at each item), and every ``~``
        joins through ``joined``; every call and filter checks the deadline, refuses a number argument
        over the output budget (a width, a count) and a result over it; ``*``, ``+`` and ``**`` refuse a
        result over it before computing it; the output is counted as it is written
    any failure ──▶ BadRequest (400) naming the model's template, where it failed (its line) and why

Jinja2's own sandbox caps ``range`` but not nesting, so a loop inside a loop would otherwise run unchecked,
and a doubling string would take the host's memory. A render's time counts from when a thread takes it up; it
gives the GIL up every YIELD_EVERY_S, so the event loop waits less for it than Python's switch interval.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.visitor

from mpserve.errors import BadRequest
from mpserve.wire.protocol import MAX_PROMPT_CHARS, ChatTemplate

RENDER_THREADS = 4
YIELD_EVERY_S = 0.001  # a render's turns at the GIL


@dataclass(frozen=True)
class TemplateBudget:
    seconds: float = 2.0  # a render's time from its start (--template-timeout)
    max_chars: int = MAX_PROMPT_CHARS  # its output, and any string or list it builds (--template-max-chars)


class Renderer:
    """Renders chat templates in threads of its own, each render within ``budget``."""

    def __init__(self, budget: TemplateBudget = TemplateBudget()) -> None:
        self.budget = budget
        self._threads = ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix="chat-template")

    async def render(self, chat: ChatTemplate, messages: Sequence[tuple[str, str] | dict[str, Any]],
                     tools: list[dict[str, Any]] | None, model: str, variables: dict[str, Any] | None = None) -> str:
        """``render`` in a thread; the event loop serves other requests meanwhile."""
        work = functools.partial(render, chat, messages, tools, model=model, budget=self.budget, variables=variables)
        return await asyncio.get_running_loop().run_in_executor(self._threads, work)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def render(chat: ChatTemplate, messages: Sequence[tuple[str, str] | dict[str, Any]],
           tools: list[dict[str, Any]] | None = None, *, model: str = "",
           budget: TemplateBudget = TemplateBudget(), variables: dict[str, Any] | None = None) -> str:
    """The prompt for ``messages`` ((role, content), or Hugging Face's message mappings, with tool calls),
    ending where the assistant's reply begins; ``tools`` (OpenAI's function list) is the template's ``tools``
    variable, left undefined when None; ``variables``: more of them (a request's ``chat_template_kwargs``, such as
    ``enable_thinking``). A template that fails, refuses the conversation with
    ``raise_exception``, or goes over ``budget`` is a BadRequest naming ``model``'s template and why."""
    name = f"the chat template of model {model!r}" if model else "the model's chat template"
    extra = (variables or {}) | ({"tools": tools} if tools is not None else {})
    _budget.deadline, _budget.limits = time.monotonic() + budget.seconds, budget
    try:
        template = _compiled(chat.template)
        prompt = _counted(template.generate(
            messages=[m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages],
            add_generation_prompt=True, bos_token="", eos_token=chat.eos_token, **extra))
    except _Refusal as exc:
        raise BadRequest(f"{name} refused the messages: {exc}") from None
    except _OverBudget as exc:
        raise BadRequest(f"{name} {exc}{_line(exc)}; the gateway's --template-timeout and --template-max-chars set "
                         "these budgets") from None
    except jinja2.TemplateSyntaxError as exc:
        raise BadRequest(f"{name} is not valid Jinja2: line {exc.lineno}: {exc.message}") from None
    except Exception as exc:  # a template's error is any of Python's (1/0, a missing key, a recursion)
        raise BadRequest(f"{name} failed{_line(exc)}: {type(exc).__name__}: {exc}") from None
    finally:
        _budget.limits = None
    return prompt


class _Refusal(Exception):
    """``raise_exception`` called by a template: it refuses the conversation."""


class _OverBudget(Exception):
    """A render that went over its time or output budget."""


class _Budget(threading.local):
    deadline = 0.0
    yield_at = 0.0
    limits: TemplateBudget | None = None


_budget = _Budget()


def _tick() -> None:
    now = time.monotonic()
    if now > _budget.deadline:
        seconds = _budget.limits.seconds if _budget.limits else 0
        raise _OverBudget(f"did not finish within {seconds:g} s (the gateway's template time budget)")
    if now > _budget.yield_at:  # the GIL to the event loop, if it waits, rather than at Python's switch interval
        time.sleep(0)
        _budget.yield_at = now + YIELD_EVERY_S


def _max_chars() -> int:
    return _budget.limits.max_chars if _budget.limits else MAX_PROMPT_CHARS


def _check_size(size: float, what: str) -> None:
    if size > _max_chars():
        raise _OverBudget(f"{what} over {_max_chars()} characters (the gateway's template output budget)")


def _size(value: Any) -> int:
    """Characters in a string; in a list or tuple, its items and the characters of its strings."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(v) for v in value if isinstance(v, str))
    return 0


def _counted(pieces: Iterable[str]) -> str:
    out: list[str] = []
    written = 0
    for piece in pieces:
        _tick()
        written += len(piece)
        _check_size(written, "wrote")
        out.append(piece)
    return "".join(out)


def _line(exc: BaseException) -> str:
    """Where in the template ``exc`` was raised (Jinja2 rewrites its traceback to the template's lines)."""
    lines = [frame.lineno for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == "<template>"]
    return f" at line {lines[-1]}" if lines else ""


def _checked_arguments(args: Iterable[Any]) -> None:
    for arg in args:
        if isinstance(arg, (int, float)) and not isinstance(arg, bool) and abs(arg) > _max_chars():
            raise _OverBudget(f"passed {arg:g} to a function, over {_max_chars()} (the gateway's template output "
                              "budget: no width or count may exceed it)")


def _before_call(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], values: int = 0) -> None:
    """Refuse a call past the deadline, with a number argument (after the first ``values``) over the output
    budget, or a ``replace`` (the filter's or a string's) whose result would be over it."""
    _tick()
    _checked_arguments(args[values:])
    _checked_arguments(kwargs.values())
    if getattr(func, "__name__", "").removeprefix("do_") == "replace":  # the filter is do_replace
        bound = getattr(func, "__self__", None)
        texts = [a for a in ((bound,) if isinstance(bound, str) else ()) + args if isinstance(a, str)]
        if len(texts) >= 3:
            text, old, new = texts[:3]
            _check_size(len(text) + text.count(old) * max(len(new) - len(old), 0), "would build a string")


def _budgeted_filter(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` within the budget; the value it filters (after its context or environment, when it takes one)
    may be any number: its other arguments are the widths and counts."""
    values = 2 if hasattr(func, "jinja_pass_arg") else 1

    @functools.wraps(func)  # keeps jinja_pass_arg: the filter still gets its context or environment
    def filtered(*args: Any, **kwargs: Any) -> Any:
        _before_call(func, args, kwargs, values)
        result = func(*args, **kwargs)
        _check_size(_size(result), "built a value")
        return result
    return filtered


class _BudgetedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox whose loops, calls, filters and growing operators keep to the budget of the
    render in progress (``_budget``, per thread)."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        self.filters = {name: _budgeted_filter(f) for name, f in self.filters.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja2's)
        _before_call(__obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(_size(result), "built a value")
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if _size(sequence) and isinstance(count, int):
                    _check_size(_size(sequence) * count, "would build a value")
        elif operator == "+":
            _check_size(_size(left) + _size(right), "would build a value")
        elif isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(left) > 1 and right > 0:
            _check_size(right * math.log10(abs(left)), "would build a number of digits")
        return super().call_binop(context, operator, left, right)

    def step(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """What a loop iterates: ``iterable``, the deadline checked at each item."""
        for item in iterable:
            _tick()
            yield item

    def joined(self, *parts: Any) -> str:
        """What ``~`` builds, refused before it is built when it would be over the budget."""
        texts = [str(p) for p in parts]
        _check_size(sum(map(len, texts)), "would build a string")
        return "".join(texts)


class _Stepped(jinja2.visitor.NodeTransformer):
    """A template's tree with its loops stepping through ``_BudgetedSandbox.step`` and its ``~`` through
    ``joined``."""

    def visit_For(self, node: jinja2.nodes.For) -> jinja2.nodes.Node:
        self.generic_visit(node)  # in place: a For stays a For
        node.iter = _environment_call("step", [node.iter], node)
        return node

    def visit_Concat(self, node: jinja2.nodes.Concat) -> jinja2.nodes.Node:
        self.generic_visit(node)
        return _environment_call("joined", node.nodes, node)


def _environment_call(method: str, args: list[Any], at: jinja2.nodes.Node) -> jinja2.nodes.Call:
    where = {"lineno": at.lineno, "environment": at.environment}
    return jinja2.nodes.Call(jinja2.nodes.EnvironmentAttribute(method, **where), args, [], None, None, **where)


@functools.lru_cache(maxsize=16)
def _compiled(source: str) -> Any:
    """A template compiled once, not on every chat request (a model's template is kilobytes of Jinja)."""
    env = _BudgetedSandbox()
    return env.from_string(_Stepped().visit(env.parse(source)))


def _raise_exception(message: str) -> None:
    raise _Refusal(message)
