"""A streamed reply's tool calls as they form: each piece of text in, the deltas it adds out (content, a call's
name, more of a call's arguments), as vLLM's streaming tool parsers send them.

    piece ──push──▶ the text so far ──Family.scan (not final)──▶ content before the calls, calls so far
                                        ──▶ Delta: the content not sent yet; each call, in order, once its name is
                                            known and offered: its name, then its arguments as they grow
    end of the reply ──finish──▶ the same on the whole text (final), then whether it held calls: read()

The text before a possible call is held back only as long as it may be one (an opener's first characters at its
end; a reply that begins like the generic JSON family's calls, ``{``, ``[`` or a code fence, until it ends). What
was sent is never taken back: a reply whose calls turn out malformed at its end has streamed them (the whole
reply reads such a reply as content); one that streamed no call gives its held text as content (a family of
channels, Harmony, its answer's messages only).
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Family, Found, Scan, Tools, read


@dataclass(frozen=True)
class Delta:
    """Content, or a call's (``index``): its opening (``name``), or more of its ``arguments``."""

    content: str = ""
    index: int = -1
    name: str | None = None
    arguments: str = ""


class CallStream:
    """One reply's stream through ``family`` (and ``fallback``, read at the end when ``family`` finds no call)."""

    def __init__(self, family: Family, tools: Tools, fallback: Family | None = None) -> None:
        self._family, self._tools, self._fallback = family, tools, fallback
        self._text = ""
        self._content = 0  # characters of content sent
        self._sent: list[int] = []  # per call opened: the characters of its arguments sent

    @property
    def text(self) -> str:
        return self._text

    def push(self, piece: str) -> list[Delta]:
        self._text += piece
        scan = self._family.scan(self._text, False, self._tools)
        content = scan.content
        if not self._sent and self._fallback is not None:
            fallback = self._fallback.scan(self._text, False, self._tools).content
            content = content[:min(len(content), len(fallback))]
        return self._deltas(Scan(content, scan.calls))

    def finish(self) -> tuple[list[Delta], list[Found] | None]:
        """The deltas the end of the reply adds, and its calls (None: it holds none, or they are malformed)."""
        found = read(self._family, self._text, self._tools)
        if found is not None or self._sent:
            return self._deltas(self._family.scan(self._text, True, self._tools)), found[1] if found else None
        if self._fallback is not None and (found := read(self._fallback, self._text, self._tools)) is not None:
            return self._deltas(self._fallback.scan(self._text, True, self._tools)), found[1]
        if self._family.channels:
            return self._deltas(Scan(self._family.scan(self._text, True, self._tools).content, ())), None
        rest, self._content = self._text[self._content:], len(self._text)
        return ([Delta(content=rest)] if rest else []), None

    def _deltas(self, scan: Scan) -> list[Delta]:
        out = []
        if len(scan.content) > self._content and not self._sent:
            out.append(Delta(content=scan.content[self._content:]))
            self._content = len(scan.content)
        for i, call in enumerate(scan.calls):
            if i == len(self._sent):
                if call.name not in self._tools:
                    break
                out.append(Delta(index=i, name=call.name))
                self._sent.append(0)
            if len(call.arguments) > self._sent[i]:
                out.append(Delta(index=i, arguments=call.arguments[self._sent[i]:]))
                self._sent[i] = len(call.arguments)
        return out
