"""Which chat template the broker hands out for a model (STATS, which every gateway renders chat requests with),
and what becomes of the template a READY brings. Pure functions; the broker applies them.

    the server's configuration ──▶ ``expected``: the template its own instances serve (the ``chat_template``
                                   setting, else the GGUF's own; ``mpserve.server.layout.served_template``)
    READY with a template:
        a local worker ──▶ the first is taken (over a remote pool's), and one that is ``expected`` while the one
                           handed out is not; later ones that differ are logged only
        a remote pool ──▶ one that equals the template handed out (or, before any, ``expected``) is taken if
                          nothing is yet; one that differs is refused (the pool does not register)
    a reload that rolls the model (``rolled``) ──▶ the new ``expected`` handed out at once; the first instance of
                                                   the new settings gives its BOS and EOS texts

A remote pool never changes a template a local instance gave: a pool's key lets it serve a model, not tell every
tenant's chat how to read (a rogue pool would put its own instructions into every conversation). Before a local
instance has loaded the model (it starts at zero, or only remote pools serve it), a pool whose template is the
server's own lends its BOS and EOS token texts; before any has told one, STATS hands out what the server read from
the GGUF's header (``Tables.chat_before_load``: the template and the EOS text it uses, BOS rendering empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from mpserve.wire.protocol import ChatTemplate


class Verdict(Enum):
    TAKE = "take"  # the model's template from now on
    SAME = "same"  # nothing to do: no template, or the one handed out
    DIFFERS = "differs"  # a local instance's: logged, not taken; a remote pool's: refused


@dataclass(frozen=True)
class Held:
    """The template a model's instances were found to serve, and whether a local one gave it."""

    chat: ChatTemplate = ChatTemplate()
    local: bool = False


def judge(held: Held, expected: str | None, got: ChatTemplate, local: bool) -> Verdict:
    """What becomes of ``got``, the template in a READY from a ``local`` worker or a remote pool's, when the
    model's is ``held`` and the server's configuration says ``expected`` (None: it says nothing: the echo backend,
    an embedding model)."""
    if not got:  # not loaded yet, or no template at all: nothing said
        return Verdict.SAME
    if local:
        if got == held.chat:
            return Verdict.SAME
        takes = not held.local or got.template == expected != held.chat.template  # a reload changed it
        return Verdict.TAKE if takes else Verdict.DIFFERS
    if held.chat:
        return Verdict.SAME if got == held.chat else Verdict.DIFFERS
    return Verdict.TAKE if got.template == expected else Verdict.DIFFERS


def differs(model: str, held: Held) -> str:
    """Why a remote pool's READY whose template differs is refused (after "refused a READY from …: ")."""
    source = ("the one its first local instance loaded" if held.local
              else "the server's own (its chat_template setting, else the GGUF's)")
    return (f"its chat template for model {model}, or its BOS or EOS token text, differs from {source}; a pool serves "
            "a model with the server's template: give it the same GGUF file, or the same chat_template setting")


def rolled(held: Held, expected: str | None) -> Held:
    """What is handed out once a reload rolls the model onto settings whose template is ``expected`` (None: the
    server cannot tell): that one at once, with the BOS and EOS texts held so far, and as no local instance's, so
    the first instance of the new settings that registers gives its own."""
    return Held(held.chat if expected is None else ChatTemplate(expected, held.chat.bos_token, held.chat.eos_token))
