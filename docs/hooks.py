"""The docs' generated parts, made from the code and kept in the pages themselves, so a page reads the same on
GitHub, in an editor and on the site; one command rewrites them, and a stale one fails the strict build
(mkdocs hook: ``hooks:`` in mkdocs.yml) and tests/test_docs.py.

    <!-- generated: NAME -->            ──GENERATORS[NAME]()──▶  the part, up to <!-- end generated -->
    <!-- generated: file PATH -->       ──the file at PATH───▶  a fenced code block of it

    settings     mpserve/config/settings.py   every setting: flag, commands, environment, YAML key, default, meaning
    errors       mpserve/errors.py            every ErrorCode: HTTP status, meaning, whether to retry
    openapi      GET /openapi.json            every route of the gateway: parameters, body fields, statuses
    wire-*       mpserve/wire/messages.py     the message types, each body's fields with types and limits
    kubernetes   deploy/kubernetes/README.md, its headings one level down and its links named as repo paths
    file PATH    an example file of the repository (examples/two_models.yaml, ...)
    plot NAME    docs/results/NAME.json   a benchmark plot's image and the commands and dates of its figures
                 (the image itself, docs/plots/NAME.svg, is drawn by plots.py: --write draws it, --check checks it)

    python docs/hooks.py --write    rewrites every stale part of docs/**/*.md and every stale plot (the command
                                    development.md names)
    python docs/hooks.py --check    lists the stale parts, exit status 1 when there is one
    python docs/hooks.py NAME       prints one part
"""

from __future__ import annotations

import dataclasses
import logging
import posixpath
import re
import sys
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import plots  # docs/plots.py: mkdocs, like `python docs/hooks.py`, has this folder on sys.path

from mpserve import errors
from mpserve.config import settings
from mpserve.wire import protocol as wire

ROOT = Path(__file__).resolve().parents[1]
COMMAND = plots.COMMAND
# each marker on a line of its own (one named in a sentence, in backquotes, is no marker)
OPENING = re.compile(r"^<!-- generated: ([^>\n]*?) -->$", re.M)
BLOCK = re.compile(r"^<!-- generated: (?P<spec>[^>\n]*?) -->\n(?P<body>.*?)^<!-- end generated -->$", re.M | re.S)
log = logging.getLogger("mkdocs.hooks.generated")  # under "mkdocs": a warning fails the --strict build


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """mkdocs' hook: a stale part is a warning (so ``--strict`` fails) naming the command that rewrites it; the
    site shows every part as the code makes it now."""
    for spec in stale(markdown):
        log.warning("docs/%s: the generated part '%s' is stale: run `%s`", page.file.src_uri, spec, COMMAND)
    return render(markdown)


def render(markdown: str) -> str:
    """``markdown`` with the part between each pair of markers made again; a marker without its end, or an
    unknown name, raises."""
    if len(OPENING.findall(markdown)) != len(BLOCK.findall(markdown)):
        raise ValueError("docs: a `<!-- generated: NAME -->` marker has no `<!-- end generated -->` after it")
    return BLOCK.sub(lambda m: block(m.group("spec")), markdown)


def stale(markdown: str) -> list[str]:
    """The spec of each part of ``markdown`` that differs from what the code makes now."""
    return [m.group("spec") for m in BLOCK.finditer(markdown) if m.group(0) != block(m.group("spec"))]


def block(spec: str) -> str:
    return f"<!-- generated: {spec} -->\n\n{part(spec).strip()}\n\n<!-- end generated -->"


def part(spec: str) -> str:
    name, _, argument = spec.partition(" ")
    if name == "file":
        return file_part(argument)
    if name == "plot":
        return plots.caption(argument)
    if name not in GENERATORS or argument:
        raise KeyError(f"docs: no generator {spec!r}; known: file PATH, plot NAME, {', '.join(GENERATORS)}")
    return GENERATORS[name]()


FENCES = {".yaml": "yaml", ".yml": "yaml", ".service": "ini", ".py": "python", ".sh": "sh"}


def file_part(path: str) -> str:
    """A file of the repository as a fenced code block, its language from its suffix."""
    source = (ROOT / path).resolve()
    if not source.is_relative_to(ROOT) or source.suffix not in FENCES:
        raise ValueError(f"docs: {path!r} is no file of the repository with a suffix of {', '.join(FENCES)}")
    return f"```{FENCES[source.suffix]}\n{source.read_text().rstrip()}\n```"


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


# --- settings and error codes -----------------------------------------------------------------------------

SETTING_GROUPS = {
    "model": ("Model settings", "Each entry of the file's `models` list; as a flag or variable, every model."),
    "server": ("Server settings", "The server as a whole: top-level keys of the file."),
    "cli": ("HTTP gateway flags", "Flags and variables of `mpserve gateway` and of the gateways `start --http` runs "
            "(no file key); their ranges are checked by the command line."),
}


def settings_part() -> str:
    """Every setting of mpserve/config/settings.py under its group: a heading (its key, so its anchor is `#n_ctx`
    on GitHub and on the site alike) and one line with its flag and the commands that take it, its variable, its
    YAML key and its default, then what it does."""
    out = []
    for scope, (title, intro) in SETTING_GROUPS.items():
        out += [f"## {title}", "", intro, ""]
        for s in settings.scoped(scope):  # type: ignore[arg-type]
            ways = []
            if s.flag:
                choices = " " + "|".join(s.choices) if s.choices else ""
                ways.append(f"`{s.flag}{choices}` ({', '.join((*s.commands, *s.own_in))})")
            ways += [f"`{s.env}`"] * bool(s.env) + [f"`{s.yaml}`"] * bool(s.yaml)
            out += [f"### {s.key}", "",
                    " · ".join(ways) + f" · default: **{s.default}**", "", s.help + ".", ""]
    return "\n".join(out)


def errors_part() -> str:
    return errors.markdown_table()


# --- the HTTP API, from the document the gateway serves ---------------------------------------------------

def openapi_document() -> dict[str, Any]:
    """``GET /openapi.json`` of a gateway app, asked in process (no server, no socket)."""
    from starlette.testclient import TestClient

    from mpserve.gateway.app import GatewayConfig, create_app

    with TestClient(create_app(GatewayConfig()), base_url="http://127.0.0.1", raise_server_exceptions=True) as http:
        response = http.get("/openapi.json")
    response.raise_for_status()
    document: dict[str, Any] = response.json()
    return document


def openapi_part() -> str:
    doc = openapi_document()
    out = [f"OpenAPI {doc['openapi']}, *{doc['info']['title']}* {doc['info']['version']}.", ""]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out += [f"### {method.upper()} `{path}`", "", op.get("summary", ""), ""]
            if op.get("security") == [{"bearer": []}, {}]:
                out += ["With `--api-key`: `Authorization: Bearer KEY`.", ""]
            params = op.get("parameters", [])
            if params:
                out += ["| parameter | in | required | type |", "|---|---|---|---|"]
                out += [f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                        f"{_schema_type(doc, p.get('schema', {}))} |" for p in params]
                out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                out += _body_table(doc, _resolve(doc, body))
            out += ["| status | meaning |", "|---|---|"]
            for status, answer in op.get("responses", {}).items():
                answer = _resolve(doc, answer)
                kinds = ", ".join(f"`{k}`" for k in answer.get("content", {}))
                out.append(f"| {status} | {answer.get('description', '')}{' (' + kinds + ')' if kinds else ''} |")
            out.append("")
    return "\n".join(out)


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = doc
        for key in node["$ref"].lstrip("#/").split("/"):
            target = target[key]
        node = target
    return node


def _body_table(doc: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """One row per field; fields described alike (llama-server's ignored ones, say) share one row."""
    required = set(schema.get("required", ()))
    rows: dict[str, list[str]] = {}  # a row's other cells -> its fields
    for name, prop in schema.get("properties", {}).items():
        prop = _resolve(doc, prop)
        meaning = "; ".join(filter(None, (_constraints(prop), prop.get("description", ""))))
        cells = f"{_schema_type(doc, prop)} | {'yes' if name in required else 'no'} | {meaning}"
        rows.setdefault(cells if prop.get("description") else f"{name}\0{cells}", []).append(name)
    return ["| body field | type | required | limits and meaning |", "|---|---|---|---|",
            *(f"| {', '.join(f'`{n}`' for n in names)} | {key.split(chr(0))[-1]} |" for key, names in rows.items()),
            ""]


def _schema_type(doc: dict[str, Any], schema: dict[str, Any]) -> str:
    schema = _resolve(doc, schema)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(dict.fromkeys(_schema_type(doc, s) for s in schema[key]))
    kind = schema.get("type", "any")
    if isinstance(kind, list):
        kind = " or ".join(kind)
    if kind == "array" and "items" in schema:
        kind = f"array of {_schema_type(doc, schema['items'])}"
    return f"{kind}{' (nullable)' if schema.get('nullable') else ''}"


def _constraints(schema: dict[str, Any]) -> str:
    words = {"minimum": "≥ {}", "maximum": "≤ {}", "exclusiveMinimum": "> {}", "exclusiveMaximum": "< {}",
             "minLength": "at least {} characters", "maxLength": "at most {} characters",
             "minItems": "at least {} items", "maxItems": "at most {} items", "default": "default {}"}
    found = [text.format(_short(schema[key])) for key, text in words.items() if key in schema]
    if "enum" in schema:
        found.append("one of " + ", ".join(f"`{v}`" for v in schema["enum"]))
    return "; ".join(found)


def _short(value: Any) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return text if len(text) < 40 else text[:37] + "…"


# --- the wire, from mpserve/wire/messages.py --------------------------------------------------------------------

ID = f"string, at most {wire.MAX_ID_CHARS} characters (`MAX_ID_CHARS`)"
MODEL = "string, at most 256 characters"
ADAPTER_NAME = f"a LoRA adapter's name, `{wire.ADAPTER_NAME_PATTERN}`"
TIMEOUT = "seconds, 0.001 to 604800 (7 days)"
TOKENS = "int32 little-endian token ids (`pack_tokens`)"

# The limits ``check`` enforces and what a field's type alone does not say, by ``Class.field``; the types, defaults,
# the limits declared with ``Meta`` and the sampling parameters' meanings come from the classes themselves.
# tests/test_docs.py checks every key names a field and that the limits it can probe hold.
LIMITS: dict[str, str] = {
    "Request.id": ID, "Request.prompt": f"at most {wire.MAX_PROMPT_CHARS} characters (`MAX_PROMPT_CHARS`)",
    "Request.model": MODEL + "; may be left out when the server serves one model", "Request.timeout": TIMEOUT,
    "Request.tokens": f"{TOKENS}, at most {wire.MAX_PROMPT_CHARS}, each ≥ 0; replaces `prompt` when not empty",
    "GenerateParams.seed": "0 to 2³² − 1",
    "GenerateParams.stop": f"at most {wire.MAX_STOP_STRINGS} strings of 1 to {wire.MAX_STOP_CHARS} characters",
    "GenerateParams.logit_bias": f"at most {wire.MAX_LOGIT_BIAS} pairs; bias −100 to 100",
    "GenerateParams.grammar": "at most 64 KiB", "GenerateParams.json_schema": "at most 64 KiB",
    "GenerateParams.prompt_logprobs": "needs `logprobs`", "GenerateParams.n": f"1 to {wire.MAX_CHOICES}, "
                                                                             "and at most the model's `parallel`",
    "Cancel.id": ID, "Chunk.id": ID, "Chunk.text": f"at most {wire.MAX_PROMPT_CHARS} characters",
    "Chunk.index": f"0 to {wire.MAX_CHOICES - 1}", "Done.id": ID, "Done.index": f"0 to {wire.MAX_CHOICES - 1}",
    "Done.finish_reason": "`length` or `stop` (or `tool_calls` over HTTP)",
    "Error.id": ID + "; nil when the failing message had no usable id",
    "Error.code": "one of the [error codes](#errors)", "Error.message": "at most 65536 characters",
    "Error.retry_after": "seconds; with `busy`",
    "Tokenize.id": ID, "Tokenize.model": MODEL, "Tokenize.text": f"at most {wire.MAX_PROMPT_CHARS} characters",
    "Tokenize.tokens": f"{TOKENS}, at most {wire.MAX_PROMPT_CHARS}", "Tokenize.timeout": TIMEOUT,
    "Tokenize.ticket": "set by the broker; a client leaves it out",
    "Tokens.id": ID, "Tokens.tokens": TOKENS, "Tokens.piece_ends": TOKENS + " (byte offsets into `pieces`)",
    "Embed.id": ID, "Embed.model": MODEL,
    "Embed.texts": f"1 to {wire.MAX_EMBED_INPUTS} non-empty strings of at most {wire.MAX_PROMPT_CHARS} characters; "
                   "or `tokens`, not both",
    "Embed.tokens": f"1 to {wire.MAX_EMBED_INPUTS} non-empty {TOKENS} arrays", "Embed.timeout": TIMEOUT,
    "Embed.ticket": "set by the broker; a client leaves it out",
    "Embeddings.id": ID, "Embeddings.vectors": "float32 little-endian, `dim` per input, in input order",
    "Control.id": ID, "Control.op": "one of " + ", ".join(f"`{op}`" for op in wire.CONTROL_OPS),
    "Control.min": f"0 to {wire.MAX_INSTANCES}", "Control.max": f"1 to {wire.MAX_INSTANCES}, ≥ `min`",
    "Control.path": "at most 4096 characters; only for `add`", "ControlReply.id": ID,
    "SlotAction.id": ID, "SlotAction.action": "one of " + ", ".join(f"`{a}`" for a in wire.SLOT_ACTIONS),
    "SlotAction.slot": "0 to 1023", "SlotAction.filename": f"at most {wire.MAX_FILENAME_CHARS} characters; "
                                                            "needed by save and restore",
    "SlotAction.worker": "an instance's identity (`w0`, `w1`, … as `mpserve status` shows)",
    "SlotReply.id": ID, "Ready.protocol": "the link revision, `WORKER_LINK`", "Ready.chat_template":
        f"at most {wire.MAX_TEMPLATE_CHARS} characters",
    "Assign.ticket": f"at most {wire.MAX_ID_CHARS} characters",
    "Assign.generated": f"{TOKENS}, at most {wire.MAX_TOKENS_LIMIT}", "Assign.index": f"0 to {wire.MAX_CHOICES - 1}",
    "Logprobs.tokens": TOKENS, "Logprobs.logprobs": "float64 little-endian, one per token",
    "Logprobs.top_tokens": TOKENS + ", `top` per token", "Logprobs.top_logprobs": "float64, `top` per token",
    "Logprobs.piece_ends": TOKENS + " (byte offsets into `pieces`)",
    "CacheChanges.added": f"at most {wire.MAX_CACHE_ITEMS} `[id, uint64 hashes]` entries",
    "Request.adapters": f"at most {wire.MAX_ADAPTERS} `[name, scale]`: names the model serves, scales "
                        f"{-wire.MAX_ADAPTER_SCALE:g} to {wire.MAX_ADAPTER_SCALE:g}",
    "Ready.adapters": f"the LoRA adapters loaded, at most {wire.MAX_LOADED_ADAPTERS}",
    "AdapterAction.id": ID, "AdapterAction.op": "one of " + ", ".join(f"`{op}`" for op in wire.ADAPTER_OPS),
    "AdapterAction.name": ADAPTER_NAME, "AdapterAction.model": MODEL,
    "AdapterAction.path": "at most 4096 characters; only for `load`: a LoRA adapter GGUF on the worker's host",
    "AdapterAction.ticket": "set by the broker",
    "AdapterReply.id": ID, "AdapterReply.name": ADAPTER_NAME,
    "AdapterReply.adapters": f"the instance's adapters now, at most {wire.MAX_LOADED_ADAPTERS}",
    "Request.traceparent": "W3C trace context (version 00) its spans continue ([traces](tracing.md)); another "
                           "value starts a new trace",
    "Request.reattach": "sent again after the server went silent ([adoption](operations.md#when-the-server-dies))",
    "Ready.live": "an orphaned instance's held requests and last answers, for the server that adopts it",
    "Heartbeat.pid": "from a broker: its server's process id, which an adopted instance watches",
    "Pong.server": "this start of the server; another one tells a client to send its requests again",
    "Live.text": f"at most {4 * wire.MAX_PROMPT_CHARS} characters: the whole text it streamed",
    "Live.generated": f"{TOKENS}, at most {wire.MAX_TOKENS_LIMIT}: the ids it generated",
    "Live.answered": "it ended just before the death (DONE or ERROR sent): an ASSIGN of it is answered again",
}

CLIENT_MESSAGES = ("Request", "Cancel", "Ping", "StatsQuery", "Tokenize", "Control", "Embed", "SlotAction")
ANSWERS = ("Chunk", "Chunks", "Done", "Error", "Pong", "Stats", "Tokens", "ControlReply", "Embeddings", "SlotReply")
WORKER_LINK_MESSAGES = ("Ready", "Heartbeat", "Failed", "Unloaded", "Leaving", "Assign", "Assigns", "Stop", "Unload",
                        "AdapterAction", "AdapterReply", "Preempt", "Parked", "HandOff", "Live")
NESTED = ("GenerateParams", "Usage", "Timings", "Logprobs", "ModelStats", "ModelScaling", "WorkerStats",
          "TenantStats", "ModelControl", "CacheChanges")


def message_classes() -> dict[str, type]:
    """Every body class of the wire: the message types and the maps nested in them."""
    names = (*CLIENT_MESSAGES, *ANSWERS, *WORKER_LINK_MESSAGES, *NESTED)
    return {name: getattr(wire, name) for name in names}


def wire_fields(cls: Any) -> list[tuple[str, str, str]]:
    """(name, msgpack type, default or "required") of each field of a body class (a msgspec Struct or a
    dataclass)."""
    if issubclass(cls, msgspec.Struct):
        hints = typing.get_type_hints(cls)
        return [(f.name, _wire_type(hints[f.name]), _default(f.default, f.default_factory, msgspec.NODEFAULT))
                for f in msgspec.structs.fields(cls)]
    hints = typing.get_type_hints(cls, vars(wire))
    return [(f.name, _wire_type(hints[f.name]), _default(f.default, f.default_factory, dataclasses.MISSING))
            for f in dataclasses.fields(cls)]


def _default(value: Any, factory: Any, missing: Any) -> str:
    if value is missing and factory is missing:
        return "required"
    value = factory() if value is missing else value
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (bytes, str, tuple, list, dict)) and not value:
        return '""' if isinstance(value, str) else "empty"
    if dataclasses.is_dataclass(value) or isinstance(value, msgspec.Struct):
        return "its defaults"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _wire_type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        kinds = [_wire_type(a) for a in args if a is not type(None)]
        return " or ".join(kinds) + (" or nil" if type(None) in args else "")
    if origin in (tuple, list):
        return "array" if not args else f"array of {_wire_type(args[0])}" if len(args) == 2 and args[1] is ... \
            or origin is list else "array [" + ", ".join(_wire_type(a) for a in args) + "]"
    if origin is dict:
        return f"map of {_wire_type(args[0])} to {_wire_type(args[1])}"
    simple = {str: "str", int: "int", float: "float", bool: "bool", bytes: "bin"}
    if hint in simple:
        return simple[hint]
    name = getattr(hint, "__name__", str(hint))
    return f"map ([{name}](#{anchor(hint)}))"


def anchor(cls: Any) -> str:
    """The anchor of a body class's heading, as mkdocs and GitHub both make it: `#request-0x01`, `#usage`."""
    mtype = getattr(cls, "TYPE", None)
    return f"{mtype.name.lower()}-0x{mtype.value:02x}" if mtype is not None else cls.__name__.lower()


def field_table(cls: type) -> str:
    rows = ["| field | type | default | limits |", "|---|---|---|---|"]
    rows += [f"| `{field}` | {kind} | {default} | {field_limits(cls, field)} |"
             for field, kind, default in wire_fields(cls)]
    return "\n".join(rows)


def field_limits(cls: type, field: str) -> str:
    """What LIMITS says of ``cls.field``, else the limits its type declares (``Meta``), then its meaning."""
    metas = _metas(typing.get_type_hints(cls, include_extras=True)[field])
    bound = {k: getattr(m, k) for m in metas for k in ("ge", "le", "max_length", "description")
             if getattr(m, k, None) is not None}
    declared = f"{_short(bound['ge'])} to {_short(bound['le'])}" if "ge" in bound and "le" in bound else \
        f"at most {bound['max_length']}" if "max_length" in bound else ""
    written = LIMITS.get(f"{cls.__name__}.{field}", declared)
    return "; ".join(part for part in (written, bound.get("description", "")) if part)


def _metas(hint: Any) -> list[msgspec.Meta]:
    """The Meta of a field's type, through ``X | None``."""
    if typing.get_origin(hint) is typing.Annotated:
        return [m for m in hint.__metadata__ if isinstance(m, msgspec.Meta)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(hint) if a is not type(None) for m in _metas(a)]
    return []


def _messages_part(names: tuple[str, ...]) -> Callable[[], str]:
    def part() -> str:
        out = []
        for name in names:
            cls = getattr(wire, name)
            mtype = getattr(cls, "TYPE", None)
            title = f"### {mtype.name} (0x{mtype.value:02x})" if mtype is not None else f"### {name}"
            doc = (cls.__doc__ or "").strip()
            if doc.startswith(name + "("):  # a dataclass's generated signature says nothing
                doc = ""
            out += [title, "", f"Body: `{name}`. " + " ".join(doc.split()), ""]
            if name in ("Chunks", "Assigns"):
                out += [f"A msgpack **array** of {name[:-1].upper()} bodies (each a map as below), not a map.", ""]
            else:
                out += [field_table(cls), ""]
        return "\n".join(out)
    return part


def types_part() -> str:
    rows = ["| type | byte | direction | frames |", "|---|---|---|---|"]
    for t in wire.MsgType:
        rows.append(f"| {t.name} | `0x{t.value:02x}` | {_direction(t)} | {_frames(t)} |")
    return "\n".join(rows)


def _direction(t: wire.MsgType) -> str:
    return {wire.MsgType.CANCEL: "client → broker, broker → worker", wire.MsgType.TOKENIZE: "client → broker → worker",
            wire.MsgType.EMBED: "client → broker → worker", wire.MsgType.SLOT_ACTION: "client → broker → worker",
            wire.MsgType.ERROR: "broker → client, worker → broker", wire.MsgType.CHUNK: "broker → client, worker → "
            "broker", wire.MsgType.DONE: "broker → client, worker → broker",
            wire.MsgType.TOKENS: "broker → client, worker → broker", wire.MsgType.EMBEDDINGS:
            "broker → client, worker → broker", wire.MsgType.SLOT_REPLY: "broker → client, worker → broker",
            wire.MsgType.HEARTBEAT: "broker ↔ worker"}.get(t) or (
        "client → broker" if t < 0x10 else "broker → client" if t < 0x20 else "worker → broker" if t < 0x30
        else "broker → worker")


def _frames(t: wire.MsgType) -> str:
    if t == wire.MsgType.STEP:
        return "`[VERSION, TYPE, \"\", BATCH]`"
    if 0x20 <= t < 0x30:
        return "`[VERSION, TYPE, TICKET, BODY]`"
    return "`[VERSION, TYPE, BODY]`"


def limits_part() -> str:
    names = {"MAX_MESSAGE_BYTES": "largest BODY (bytes) a server takes; PONG tells the server's own",
             "MAX_ID_CHARS": "characters of a request id (and of a ticket)",
             "MAX_PROMPT_CHARS": "characters of a prompt (and token ids of a token prompt)",
             "MAX_TOKENS_LIMIT": "highest `max_tokens`", "MAX_STOP_STRINGS": "stop strings per request",
             "MAX_STOP_CHARS": "characters per stop string", "MAX_LOGIT_BIAS": "token ids one request may bias",
             "MAX_TOP_LOGPROBS": "most probable tokens reported per token", "MAX_EMBED_INPUTS": "inputs per EMBED",
             "MAX_CHOICES": "choices (`n`) per request", "MAX_TOKEN_ID": "highest token id (int32)",
             "MAX_TEMPLATE_CHARS": "characters of a chat template", "MAX_INSTANCES": "CONTROL's `min` and `max`",
             "MAX_FILENAME_CHARS": "characters of a KV file's name"}
    rows = ["| constant | value | what it bounds |", "|---|---|---|"]
    rows += [f"| `{name}` | {getattr(wire, name)} | {what} |" for name, what in names.items()]
    return "\n".join(rows + ["", f"`VERSION` is `{wire.VERSION.decode()}`; the broker–worker link revision "
                             f"(`WORKER_LINK`) is `{wire.WORKER_LINK}`."])


def nested_part() -> str:
    return "\n".join(f"### {name}\n\n{field_table(getattr(wire, name))}\n" for name in NESTED)


# --- files of the repository shown in a page -------------------------------------------------------------

LINK = re.compile(r"\[([^\]]+)\]\(([^)#]+)\)")


def kubernetes_part() -> str:
    """deploy/kubernetes/README.md as a section: a link to a repository file becomes its path (the site holds
    only docs/)."""
    source = "deploy/kubernetes/README.md"
    text = (ROOT / source).read_text().split("\n", 1)[1]  # its title is the section's heading

    def named(m: re.Match[str]) -> str:
        if m.group(2).startswith(("http://", "https://")):
            return m.group(0)
        path = posixpath.normpath(posixpath.join(posixpath.dirname(source), m.group(2)))
        return m.group(1) if m.group(1) == f"`{path}`" else f"{m.group(1)} (`{path}`)"
    return re.sub(r"^## ", "### ", LINK.sub(named, text), flags=re.M)


GENERATORS: dict[str, Callable[[], str]] = {
    "kubernetes": kubernetes_part,
    "settings": settings_part,
    "errors": errors_part,
    "openapi": openapi_part,
    "wire-types": types_part,
    "wire-limits": limits_part,
    "wire-client": _messages_part(CLIENT_MESSAGES),
    "wire-answers": _messages_part(ANSWERS),
    "wire-workers": _messages_part(WORKER_LINK_MESSAGES),
    "wire-nested": nested_part,
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write"] or argv[:1] == ["--check"]:
        found = [(page, spec) for page in pages() for spec in stale(page.read_text())]
        images = plots.stale_images()
        done = "rewritten" if argv[0] == "--write" else "is stale"
        for page, spec in found:
            print(f"{page.relative_to(ROOT)}: '{spec}' {done}")
        for name in images:
            print(f"docs/plots/{name}.svg {done}")
        if argv[0] == "--write":
            for page in {page for page, _ in found}:
                page.write_text(render(page.read_text()))
            plots.write_images()
            return 0
        return 1 if found or images else 0
    if len(argv) == 1 and not argv[0].startswith("-"):
        print(part(argv[0]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
