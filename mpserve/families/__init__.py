"""Template families: how each model family's replies carry tool calls (and where its thinking is), one module a
family, and the one chosen for a chat template.

    the chat template's text ──for_template──▶ the family whose markers it writes (ChatML's default: Hermes; none:
        the generic JSON one) ──▶ base.read / read_forced (a whole reply), stream.CallStream (a streamed one),
        Family.grammar (a forced call in the family's own format)

A family is chosen by the text its template writes (``markers``), so a template family of
``mpserve.models.templates`` (``--chat-template NAME``) and a GGUF's own template are read alike. The order
matters where one family's markers hold another's: Harmony, Kimi, DeepSeek, GLM and Qwen3-Coder before Hermes
(``<tool_call>`` is in GLM's and Qwen3-Coder's templates too).

    base         what every family shares: a reply's calls whole (read, read_forced) and as they form (Scan)
    stream       a streamed reply's calls as they form: text in, content and call deltas out
    gbnf         GBNF for forced calls: each tool's arguments from its JSON Schema, within the family's call syntax
    xml          what the XML-like families share: a call's parameters read one by one, raw values
    hermes       Hermes and Qwen 2.5 / 3: JSON in <tool_call> tags (the ChatML default's)
    qwen3_coder  Qwen3-Coder and Qwen 3.5: <function=NAME> with a <parameter=KEY> per argument
    harmony      gpt-oss's Harmony: calls on the commentary or analysis channel, malformed headers read
    llama3       Llama 3.1 to 3.3: JSON objects with parameters, optionally after <|python_tag|>
    mistral      Mistral's two forms: a JSON list after [TOOL_CALLS], or [TOOL_CALLS]NAME[ARGS]{...}
    gemma        Gemma: a Python call in a tool_code block
    deepseek     DeepSeek V3.1 and later: calls between its tool-call tokens, name then JSON
    glm          GLM 4.5 to 4.7: the name after <tool_call>, then <arg_key>/<arg_value> pairs
    kimi         Kimi K2: functions.NAME:INDEX, then the arguments' JSON, in a calls section
    generic      plain JSON calls, for templates that teach no format, and read after any family's
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
