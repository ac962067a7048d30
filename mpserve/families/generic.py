"""Tool calls as plain JSON, for a template that teaches no format of its own, and read after any family's
parser finds none: a call object, a list of them, or ``{"tool_calls": [...]}``, fenced as a code block or not.

    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```json
    {"tool_calls": [{"function": {"name": "get_time", "arguments": "{}"}}]}
    ```

    text ──starts (after spaces) with {, [ or ```──▶ the whole reply as one JSON value, once it is complete
         ──otherwise──▶ content, never a call

Its calls are read whole (they stream as one piece at the end of the reply): a JSON value is only a call once
all of it is there. It writes no grammar: a forced call of a template without a format of its own is Hermes'.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .base import Family, Partial, Tools

FENCED = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.DOTALL)


class Generic(Family):
    name = "json"
    openers = ("{", "[", "```")
    anchored = True

    def calls(self, section: str, final: bool, tools: Tools) -> list[Partial]:
        body = section.strip()
        fenced = FENCED.fullmatch(body)
        try:
            value = json.loads(fenced.group(1) if fenced else body)
        except ValueError:
            return [Partial(None, "", final)]
        if isinstance(value, dict) and isinstance(value.get("tool_calls"), list):
            value = [c.get("function", c) if isinstance(c, dict) else c for c in value["tool_calls"]]
        if isinstance(value, dict) and "name" in value:
            value = [value]
        if not isinstance(value, list) or not value:
            return [Partial(None, "", True)]
        return [_call(raw) for raw in value]


def _call(raw: Any) -> Partial:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        return Partial(None, "", True)
    arguments = raw.get("arguments", raw.get("parameters", {}))
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return Partial(raw["name"], text, True)
