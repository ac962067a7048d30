"""Template families: how each model family's replies carry tool calls (and where its thinking is), one module a
family, and the one chosen for a chat template.

    the chat template's text ──for_template──▶ the family whose markers it writes (ChatML's default: Hermes; none:
        the generic JSON one) ──▶ base.read / read_forced (a whole reply), stream.CallStream (a streamed one),
        Family.grammar (a forced call in the family's own format)

A family is chosen by the text its template writes (``markers``), so a template family of
``mpserve.models.templates`` (``--chat-template NAME``) and a GGUF's own template are read alike. The order
matters where one family's markers hold another's: Harmony, Kimi, DeepSeek, GLM and Qwen3-Coder before Hermes
(``<tool_call>`` is in GLM's and Qwen3-Coder's templates too).
"""

from __future__ import annotations

from .base import Family, Found, Partial, Scan, Tools, read, read_forced
from .deepseek import DeepSeek
from .gemma import Gemma
from .generic import Generic
from .glm import Glm
from .harmony import Harmony
from .hermes import Hermes
from .kimi import Kimi
from .llama3 import Llama3
from .mistral import Mistral
from .qwen3_coder import Qwen3Coder

ORDER: tuple[Family, ...] = (Harmony(), Kimi(), DeepSeek(), Glm(), Qwen3Coder(), Hermes(), Mistral(), Llama3(),
                             Gemma())
"""The families a template is recognised as, first match wins."""
GENERIC = Generic()
FAMILIES: dict[str, Family] = {f.name: f for f in (*ORDER, GENERIC)}


def for_template(template: str) -> Family:
    """The family of a chat template's text: the first whose markers it writes; Hermes for the ChatML default
    (``""``); the generic JSON family for a template that teaches no tool format."""
    if not template:
        return FAMILIES["hermes"]
    return next((f for f in ORDER if any(m in template for m in f.markers)), GENERIC)


__all__ = ["FAMILIES", "GENERIC", "Family", "Found", "Partial", "Scan", "Tools", "for_template", "read",
           "read_forced"]
