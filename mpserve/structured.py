"""Structured output: grammars and JSON Schemas checked, and schemas compiled to GBNF, in one place.

    GenerateParams.validate ──▶ check_grammar(text)      size and nesting (llama.cpp parses it at admission)
    (client, gateway,        └─▶ check_schema(text)      size and shape: JSON, an object, its properties counted
     broker, worker)
    BatchEngine.admit        ──▶ grammar_source(params)  the GBNF text a sequence's grammar sampler gets
                                  └─▶ schema_grammar(text)  JSON Schema ──▶ GBNF, within MAX_COMPILE_S and the
                                                            grammar's size; kept per distinct schema, refusals
                                                            per digest

Every path (``Client``, the broker, the HTTP gateway, the worker) checks a request with the cheap checks, so
they refuse the same input with the same words; a schema is compiled once, by the worker that admits it (the
broker and the gateway never compile: a slow compile there would stall every request), and no llama_cpp is
imported here. Compiling is linear in the schema and stops at the first rule past the grammar's size limit or
at the time budget, and a schema refused once is refused again from its digest, without compiling. The compiler is
mpserve's own: it refuses, naming it, every keyword it cannot enforce, so that what a constrained
completion produces always validates against the schema (a completion cut by ``max_tokens`` excepted).

Supported (``SUPPORTED_KEYWORDS``): ``type`` (one or a list), ``properties``, ``required``,
``additionalProperties`` (no extra properties are generated either way), ``enum``, ``const``, ``items``
with ``minItems``/``maxItems``, strings with ``minLength``/``maxLength``, ``pattern`` (regular expressions
without lookarounds, backreferences or flags) or ``format`` (date, time, date-time, uuid), integers and
numbers with ``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum`` (a bounded number is
generated with at most six decimals, and without any when negative), ``anyOf``, and ``$ref`` into
``$defs``/``definitions`` (recursion included). Annotations (title, description, default, ...) are
ignored. Generated JSON has at most one space between tokens, and object properties come required first,
each group in the schema's order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
import re._constants as sre  # type: ignore[import-not-found]  # the parser of the re module itself
import re._parser as sre_parse  # type: ignore[import-not-found]
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from mpserve.digit_ranges import MAX_DIGITS, integers, naturals
from mpserve.errors import BadRequest

MAX_GRAMMAR_CHARS = 64 * 1024
"""GBNF text, given or compiled from a schema: what llama.cpp parses at admission, and keeps per sequence."""
MAX_SCHEMA_CHARS = 64 * 1024
LEAST_PROPERTY_CHARS = 40  # of grammar, at least, per property: its rule's line and the object's use of it
MAX_SCHEMA_PROPERTIES = MAX_GRAMMAR_CHARS // LEAST_PROPERTY_CHARS  # more could never fit the grammar: refused
MAX_COMPILE_S = 1.0  # a schema still compiling after this long is refused
REFUSALS_KEPT = 256  # refused schemas remembered (by digest) so that sending one again costs no compile
T = TypeVar("T")
MAX_GRAMMAR_NESTING = 64  # parentheses in a GBNF text (llama.cpp's parser recurses per level)
MAX_GRAMMAR_REPEATS = 16384  # the {m,n} counts of a GBNF text, summed (llama.cpp expands each into copies)
_GBNF_TOKENS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[()]'
                          r'|\{\s*(?P<low>\d*)\s*(?P<comma>,)?\s*(?P<high>\d*)\s*\}')
MAX_SCHEMA_DEPTH = 32  # nested subschemas
MAX_REPEAT = 256  # minLength/maxLength, minItems/maxItems and {m,n} in patterns
DECIMALS = 6  # fraction digits of a bounded number

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
SUPPORTED_KEYWORDS = ("type", "properties", "required", "additionalProperties", "enum", "const", "items",
                      "minItems", "maxItems", "minLength", "maxLength", "pattern", "format", "minimum",
                      "maximum", "exclusiveMinimum", "exclusiveMaximum", "anyOf", "$ref", "$defs", "definitions")
FORMATS = ("date", "time", "date-time", "uuid")
TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")

_BASE_RULES = {
    "ws": '| " "',
    "value": 'object | array | string | number | "true" ws | "false" ws | "null" ws',
    "object": '"{" ws ( string ":" ws value ( "," ws string ":" ws value )* )? "}" ws',
    "array": '"[" ws ( value ( "," ws value )* )? "]" ws',
    "string": '"\\"" char* "\\"" ws',
    "char": '[^"\\\\\\x7F\\x00-\\x1F] | "\\\\" ( ["\\\\/bfnrt] | "u" [0-9a-fA-F]{4} )',
    "number": f'"-"? ( "0" | [1-9] [0-9]{{0,{MAX_DIGITS - 1}}} ) ( "." [0-9]{{1,{MAX_DIGITS}}} )? '
              '( [eE] [-+]? [0-9]{1,3} )? ws',
    "integer": f'"-"? ( "0" | [1-9] [0-9]{{0,{MAX_DIGITS - 1}}} ) ws',
    "boolean": '( "true" | "false" ) ws',
    "null": '"null" ws',
    "date": '[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
    "time": '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
            '( "Z" | [-+] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )',
    "date-time": 'date "T" time',
    "uuid": '[0-9a-f]{8} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{12}',
}
_DEPENDS = {"value": ("object", "array", "string", "number"), "object": ("string", "value"), "array": ("value",),
            "string": ("char",), "date-time": ("date", "time")}
CLASS_SPECIAL = "]^-[\\"  # escaped inside a GBNF character class
JSON_OBJECT_SCHEMA = '{"type":"object"}'
"""``response_format: {type: json_object}``: any JSON object."""


def canonical_json(value: Any) -> str:
    """The text a JSON Schema travels as: compact, keys in their given order (the order properties come in)."""
    try:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"'json_schema' must be a JSON object: {exc}") from None


def check_grammar(text: str) -> None:
    """What can be checked of GBNF text without llama.cpp: its size and nesting. Its syntax is checked by
    llama.cpp when a worker admits the request (``llama_sampler_init_grammar``)."""
    if not text.strip():
        raise BadRequest("'grammar' is empty")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise BadRequest(f"'grammar' is {len(text)} characters, over the limit of {MAX_GRAMMAR_CHARS}")
    if "root" not in re.findall(r"^\s*([a-zA-Z0-9-]+)\s*::=", text, re.MULTILINE):
        raise BadRequest("'grammar' has no 'root' rule (GBNF: root ::= ...)")
    deepest, repeated = _measure(text, "'grammar'")
    if deepest > MAX_GRAMMAR_NESTING:
        raise BadRequest(f"'grammar' nests parentheses {deepest} deep, over the limit of {MAX_GRAMMAR_NESTING}")
    if repeated > MAX_GRAMMAR_REPEATS:
        raise BadRequest(f"'grammar' repeats items {repeated} times in all ({{m,n}} counts), over the limit of "
                         f"{MAX_GRAMMAR_REPEATS}")


def _measure(text: str, what: str) -> tuple[int, int]:
    """How deep GBNF ``text`` nests parentheses, and its {m,n} counts summed (llama.cpp expands x{m,n} into
    n copies, and never ends when n < m: that is refused here)."""
    depth = deepest = repeated = 0
    for token in _GBNF_TOKENS.finditer(text):
        if token.group() == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token.group() == ")":
            depth -= 1
        elif token.group("low") is not None:
            low = int(token.group("low") or 0)
            high = low if token.group("comma") is None else int(token.group("high") or low)
            if high < low:
                raise BadRequest(f"{what} has the repetition {token.group()}, whose maximum is below its minimum")
            repeated += high
    return deepest, repeated


def grammar_source(grammar: str | None, json_schema: str | None) -> str | None:
    """The GBNF a sequence is constrained by: ``grammar`` as given, or compiled from ``json_schema``."""
    if grammar is not None:
        return grammar
    return schema_grammar(json_schema) if json_schema is not None else None


def _refusals_kept(check: Callable[[str], T]) -> Callable[[str], T]:
    """``check`` that refuses a text it refused before from its digest, without running again."""
    refused: OrderedDict[bytes, str] = OrderedDict()

    @functools.wraps(check)
    def kept(text: str) -> T:
        digest = hashlib.sha256(text.encode(errors="surrogatepass")).digest()
        if digest in refused:
            refused.move_to_end(digest)
            raise BadRequest(refused[digest])
        try:
            return check(text)
        except BadRequest as exc:
            refused[digest] = exc.message
            while len(refused) > REFUSALS_KEPT:
                refused.popitem(last=False)
            raise
    return kept


@_refusals_kept
def check_schema(text: str) -> dict[str, Any]:
    """The JSON Schema ``text`` read, if its size and shape allow compiling it: at most MAX_SCHEMA_CHARS, a
    JSON object, at most MAX_SCHEMA_PROPERTIES properties in all its subschemas (``$defs`` included). Linear
    in the text: the broker and the gateway run it where the worker compiles."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise BadRequest(f"'json_schema' is {len(text)} characters, over the limit of {MAX_SCHEMA_CHARS}")
    try:
        schema = json.loads(text)
    except ValueError as exc:
        raise BadRequest(f"'json_schema' is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("'json_schema' nests too deep to be read") from None
    if not isinstance(schema, dict):
        raise BadRequest(f"'json_schema' must be a JSON object, got {type(schema).__name__}")
    properties, nodes = 0, [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, dict):
            found = node.get("properties")
            properties += len(found) if isinstance(found, dict) else 0
            nodes.extend(node.values())
        elif isinstance(node, list):
            nodes.extend(node)
    if properties > MAX_SCHEMA_PROPERTIES:
        raise BadRequest(f"'json_schema' has {properties} properties in all, over the limit of "
                         f"{MAX_SCHEMA_PROPERTIES} (each takes at least {LEAST_PROPERTY_CHARS} of the grammar's "
                         f"{MAX_GRAMMAR_CHARS} characters); simplify the schema")
    return schema


@functools.lru_cache(maxsize=64)
@_refusals_kept
def schema_grammar(text: str) -> str:
    """GBNF for the JSON Schema ``text``; raises BadRequest naming an unsupported keyword, a bad value, a
    grammar over MAX_GRAMMAR_CHARS or a compile over MAX_COMPILE_S."""
    schema = check_schema(text)
    try:
        grammar = _Compiler(schema, time.monotonic() + MAX_COMPILE_S).grammar()
    except RecursionError:  # a const or enum value nested deeper than json.dumps goes
        raise BadRequest("'json_schema' nests too deep to be compiled") from None
    repeated = _measure(grammar, "json_schema")[1]
    if len(grammar) > MAX_GRAMMAR_CHARS or repeated > MAX_GRAMMAR_REPEATS:
        raise BadRequest(f"json_schema: its grammar would be {len(grammar)} characters with {repeated} repetitions, "
                         f"over the limits of {MAX_GRAMMAR_CHARS} and {MAX_GRAMMAR_REPEATS}; simplify the schema")
    return grammar


def _bad(path: str, what: str) -> BadRequest:
    return BadRequest(f"json_schema at {path}: {what}")


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    return '"' + "".join(_escape(c, '"\\') for c in text) + '"'


def _escape(c: str, special: str) -> str:
    if c in special or not c.isprintable() or ord(c) > 0x7E:
        n = ord(c)
        return f"\\x{n:02X}" if n < 0x80 else f"\\u{n:04X}" if n < 0x10000 else f"\\U{n:08X}"
    return c


def _json_literal(value: Any) -> str:
    """A GBNF literal producing ``value``'s JSON text, then optional space."""
    return literal(json.dumps(value, ensure_ascii=False)) + " ws"


class _Compiler:
    """One schema's rules: each subschema becomes a rule, named after its path, shared when equal."""

    def __init__(self, schema: dict[str, Any], deadline: float) -> None:
        self._root = schema
        self._deadline = deadline
        self._rules: dict[str, str] = {}
        self._chars = 0  # the rules' text so far
        self._named: dict[tuple[str, str], str] = {}  # (a rule's name before its -N, its body) -> its rule
        self._last: dict[str, int] = {}  # a name -> the last N tried for it
        self._base: set[str] = {"ws"}
        self._refs: dict[str, str] = {}  # $ref -> its rule's name (reserved before its body is compiled)

    def grammar(self) -> str:
        self._rules["root"] = self._visit(self._root, "#", 0)
        for name in list(self._base):
            self._use(name)
        rules = {**self._rules, **{name: _BASE_RULES[name] for name in self._base}}
        return "\n".join(f"{name} ::= {body}" for name, body in rules.items()) + "\n"

    def _use(self, base: str) -> str:
        if base not in self._base:
            self._base.add(base)
        for dep in _DEPENDS.get(base, ()):
            if dep not in self._base:
                self._use(dep)
        return base

    def _rule(self, path: str, body: str) -> str:
        """A rule for ``body``, named after ``path``; an equal rule of that name is shared. Names are cut to 40
        characters, so many may collide: each name counts its ``-N`` on, keeping this linear."""
        name = "r" + re.sub(r"[^a-zA-Z0-9]+", "-", path).strip("-")[:40]
        shared = self._named.get((name, body))
        if shared is not None and self._rules[shared] == body:
            return shared
        candidate = name
        while candidate in self._rules:
            self._last[name] = self._last.get(name, 1) + 1
            candidate = f"{name}-{self._last[name]}"
        self._named[(name, body)] = candidate
        self._set(candidate, body)
        return candidate

    def _set(self, name: str, body: str) -> None:
        """Rule ``name`` is ``body``: refused as soon as the rules pass the grammar's size limit."""
        before = self._rules.get(name)
        self._chars += len(body) + (len(name) + len(" ::= \n") if before is None else -len(before))
        self._rules[name] = body
        if self._chars > MAX_GRAMMAR_CHARS:
            raise BadRequest(f"json_schema: its grammar would be over the limit of {MAX_GRAMMAR_CHARS} characters "
                             f"(compiling stopped at rule {name}); simplify the schema")

    # --- subschemas -----------------------------------------------------------------------------

    def _visit(self, schema: Any, path: str, depth: int) -> str:
        """An expression (usually a rule name) generating exactly the JSON texts this subschema allows."""
        if depth > MAX_SCHEMA_DEPTH:
            raise _bad(path, f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if time.monotonic() > self._deadline:
            raise _bad(path, f"compiling the schema took over {MAX_COMPILE_S:g} s, its limit; simplify the schema")
        if schema is True or schema == {}:
            return self._use("value")
        if not isinstance(schema, dict):
            raise _bad(path, "a subschema must be an object (or true)")
        for key in schema:
            if key not in ANNOTATIONS and key not in SUPPORTED_KEYWORDS:
                raise _bad(path, f"keyword '{key}' is not supported; supported: {', '.join(SUPPORTED_KEYWORDS)}")
        constraints = set(schema) - ANNOTATIONS
        if "$ref" in schema:
            if constraints != {"$ref"}:
                raise _bad(path, f"'$ref' with {', '.join(sorted(constraints - {'$ref'}))} beside it is not "
                                 "supported")
            return self._ref(schema["$ref"], path, depth)
        if "anyOf" in schema:
            options = schema["anyOf"]
            if constraints != {"anyOf"}:
                raise _bad(path, f"'anyOf' with {', '.join(sorted(constraints - {'anyOf'}))} beside it is not "
                                 "supported")
            if not isinstance(options, list) or not options:
                raise _bad(path, "'anyOf' must be a non-empty list")
            return self._rule(path, " | ".join(self._visit(s, f"{path}/anyOf/{i}", depth + 1)
                                               for i, s in enumerate(options)))
        if "const" in schema:
            return self._rule(path, _json_literal(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise _bad(path, "'enum' must be a non-empty list")
            return self._rule(path, " | ".join(_json_literal(v) for v in values))
        kind = schema.get("type", _implied_type(constraints))
        if isinstance(kind, list):
            if not kind or not all(isinstance(k, str) for k in kind):
                raise _bad(path, "'type' must be a type name or a non-empty list of them")
            return self._rule(path, " | ".join(self._visit({**schema, "type": k}, f"{path}/{k}", depth + 1)
                                               for k in dict.fromkeys(kind)))
        if kind is None:
            return self._use("value")
        if kind not in TYPES:
            raise _bad(path, f"'type' {kind!r} is not one of {', '.join(TYPES)}")
        if kind == "object":
            return self._object(schema, path, depth)
        if kind == "array":
            return self._array(schema, path, depth)
        if kind == "string":
            return self._string(schema, path)
        if kind in ("integer", "number"):
            return self._number(schema, path, kind == "integer")
        return self._use(kind)

    def _ref(self, ref: Any, path: str, depth: int) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _bad(path, f"'$ref' {ref!r:.80} is not supported: only references into this schema "
                             "(#/$defs/NAME) are")
        if ref in self._refs:
            return self._refs[ref]
        target: Any = self._root
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise _bad(path, f"'$ref' {ref!r:.80} points at nothing")
            target = target[part]
        name = self._rule("ref-" + ref[2:], "")  # reserved, so a recursive reference finds it
        self._set(name, "ref-placeholder")
        self._refs[ref] = name
        self._set(name, self._visit(target, ref, depth + 1))
        return name

    def _object(self, schema: dict[str, Any], path: str, depth: int) -> str:
        properties = schema.get("properties", {})
        required = schema.get("required", [])
        extra = schema.get("additionalProperties", True)
        if not isinstance(properties, dict):
            raise _bad(path, "'properties' must be an object")
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise _bad(path, "'required' must be a list of property names")
        if not isinstance(extra, (bool, dict)):
            raise _bad(path, "'additionalProperties' must be a boolean or a schema")
        if isinstance(extra, dict):
            self._visit(extra, f"{path}/additionalProperties", depth + 1)  # checked; no extra ones are made
        if not properties and not required and "additionalProperties" not in schema:
            return self._use("object")
        missing = [r for r in required if r not in properties]
        if missing and extra is False:
            raise _bad(path, f"required properties {missing} are not in 'properties' and "
                             "additionalProperties is false: no object matches")
        pairs: dict[str, str] = {}
        for name in [*properties, *missing]:
            value = self._visit(properties.get(name, True), f"{path}/properties/{name}", depth + 1)
            pairs[name] = self._rule(f"{path}/{name}-kv", f'{_json_literal(name)} ":" ws {value}')
        first = [pairs[n] for n in dict.fromkeys(required)]
        optional = [pairs[n] for n in pairs if n not in required]
        body = '"{" ws ' + ' "," ws '.join(first)
        if first:
            body += "".join(f' ( "," ws {kv} )?' for kv in optional)
        elif optional:
            tails = [""] * (len(optional) + 1)
            for i in range(len(optional) - 1, -1, -1):
                tails[i] = self._rule(f"{path}/tail-{i}", f'( "," ws {optional[i]} )? {tails[i + 1]}'.strip())
            body += "( " + " | ".join(f"{kv} {tails[i + 1]}".strip() for i, kv in enumerate(optional)) + " )?"
        return self._rule(path, body + ' "}" ws')

    def _array(self, schema: dict[str, Any], path: str, depth: int) -> str:
        item = self._visit(schema.get("items", True), f"{path}/items", depth + 1)
        low, high = self._count(schema, "minItems", "maxItems", path)
        if high == 0:
            return self._rule(path, '"[" ws "]" ws')
        more = f'( "," ws {item} )'
        if high == 1:
            items = item
        else:
            items = f"{item} {more}{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        return self._rule(path, '"[" ws ' + (items if low else f"( {items} )?") + ' "]" ws')

    def _count(self, schema: dict[str, Any], lo_key: str, hi_key: str, path: str) -> tuple[int, int | None]:
        low, high = schema.get(lo_key, 0), schema.get(hi_key)
        for key, value in ((lo_key, low), (hi_key, high)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise _bad(path, f"'{key}' must be a non-negative integer")
            if value is not None and value > MAX_REPEAT:
                raise _bad(path, f"'{key}' over {MAX_REPEAT} is not supported")
        if high is not None and high < low:
            raise _bad(path, f"'{hi_key}' is less than '{lo_key}': nothing matches")
        return low, high

    def _string(self, schema: dict[str, Any], path: str) -> str:
        fmt, pattern = schema.get("format"), schema.get("pattern")
        lengths = {"minLength", "maxLength"} & set(schema)
        if sum(map(bool, (fmt is not None, pattern is not None, lengths))) > 1:
            raise _bad(path, "only one of 'format', 'pattern' and minLength/maxLength is supported on one string")
        if fmt is not None:
            if fmt not in FORMATS:
                raise _bad(path, f"string format {fmt!r:.40} is not supported; supported: {', '.join(FORMATS)}")
            return self._rule(path, f'"\\"" {self._use(fmt)} "\\"" ws')
        if pattern is not None:
            if not isinstance(pattern, str):
                raise _bad(path, "'pattern' must be a string")
            return self._rule(path, f'"\\"" ( {_Pattern(pattern, path).gbnf()} ) "\\"" ws')
        if lengths:
            low, high = self._count(schema, "minLength", "maxLength", path)
            self._use("char")
            return self._rule(path, f'"\\"" char{{{low},{"" if high is None else high}}} "\\"" ws')
        return self._use("string")

    def _number(self, schema: dict[str, Any], path: str, integer: bool) -> str:
        bounds = {k: schema[k] for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if k in schema}
        if not bounds:
            return self._use("integer" if integer else "number")
        for key, value in bounds.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise _bad(path, f"'{key}' must be a number")
            if abs(value) >= 10 ** MAX_DIGITS:
                raise _bad(path, f"'{key}' beyond 1e{MAX_DIGITS} is not supported")
        lows = [math.ceil(bounds["minimum"])] if "minimum" in bounds else []
        lows += [math.floor(bounds["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in bounds else []
        highs = [math.floor(bounds["maximum"])] if "maximum" in bounds else []
        highs += [math.ceil(bounds["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in bounds else []
        low, high = max(lows, default=None), min(highs, default=None)
        if low is not None and high is not None and low > high:
            raise _bad(path, "no integer lies in the range, and mpserve generates numbers in a range from "
                             "their integer part: widen it")
        whole = integers(low, high)
        if integer:
            return self._rule(path, f"( {whole} ) ws")
        # k.fraction lies in [k, k + 1): allowed for k >= 0 whose k + 1 is within the upper bound
        top = min([math.floor(v) - 1 for k, v in bounds.items() if k in ("maximum", "exclusiveMaximum")],
                  default=None)
        start = max(low or 0, 0)
        if top is None or top >= start:
            fraction = f'( {naturals(start, top)} ) "." [0-9]{{1,{DECIMALS}}}'
            return self._rule(path, f"( {fraction} | {whole} ) ws")
        return self._rule(path, f"( {whole} ) ws")


def _implied_type(keys: set[str]) -> str | None:
    """The type a schema without ``type`` constrains, from its keywords (None: any value)."""
    for kind, words in (("object", {"properties", "required", "additionalProperties"}),
                        ("array", {"items", "minItems", "maxItems"}),
                        ("string", {"minLength", "maxLength", "pattern", "format"}),
                        ("number", {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})):
        if keys & words:
            return kind
    return None


class _Pattern:
    """A regular expression (``pattern``) as GBNF for the characters of a JSON string that match it
    whole; characters that would need a JSON escape are generated escaped or left out of classes."""

    _CLASSES = {sre.CATEGORY_DIGIT: "0-9", sre.CATEGORY_WORD: "a-zA-Z0-9_", sre.CATEGORY_SPACE: " "}
    _NEGATED_CLASSES = {sre.CATEGORY_DIGIT: "0-9", sre.CATEGORY_WORD: "a-zA-Z0-9_",
                        sre.CATEGORY_SPACE: " \\t\\n\\r\\x0B\\x0C"}

    def __init__(self, pattern: str, path: str) -> None:
        self._path = path
        try:
            self._tree = sre_parse.parse(pattern)
        except re.error as exc:
            raise _bad(path, f"'pattern' is not a valid regular expression: {exc}") from None
        if self._tree.state.flags & ~(sre.SRE_FLAG_UNICODE):
            raise self._unsupported("inline flags")

    def _unsupported(self, what: str) -> BadRequest:
        return _bad(self._path, f"'pattern' uses {what}, which is not supported")

    def gbnf(self) -> str:
        items = list(self._tree)
        if items and items[0][0] is sre.AT and items[0][1] in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING):
            items = items[1:]
        if items and items[-1][0] is sre.AT and items[-1][1] in (sre.AT_END, sre.AT_END_STRING):
            items = items[:-1]
        return self._sequence(items) or '""'

    def _sequence(self, items: list[tuple[Any, Any]]) -> str:
        return " ".join(self._item(op, arg) for op, arg in items)

    def _item(self, op: Any, arg: Any) -> str:
        if op is sre.LITERAL:
            return literal(json.dumps(chr(arg), ensure_ascii=False)[1:-1])
        if op is sre.NOT_LITERAL:
            return f'[^{_escape(chr(arg), CLASS_SPECIAL)}"\\\\\\x00-\\x1F]'
        if op is sre.ANY:
            return '[^"\\\\\\x00-\\x1F]'
        if op is sre.IN:
            return self._class(arg)
        if op is sre.BRANCH:
            return "( " + " | ".join(self._sequence(list(b)) or '""' for b in arg[1]) + " )"
        if op is sre.SUBPATTERN:
            group, add_flags, del_flags, sub = arg
            if add_flags or del_flags:
                raise self._unsupported("inline flags")
            return "( " + (self._sequence(list(sub)) or '""') + " )"
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            low, high, sub = arg
            if low > MAX_REPEAT or (high != sre.MAXREPEAT and high > MAX_REPEAT):
                raise self._unsupported(f"a repetition over {MAX_REPEAT}")
            body = "( " + (self._sequence(list(sub)) or '""') + " )"
            return f"{body}{{{low},{'' if high == sre.MAXREPEAT else high}}}"
        raise self._unsupported({sre.AT: "an anchor inside the pattern", sre.GROUPREF: "a backreference",
                                 sre.ASSERT: "a lookaround", sre.ASSERT_NOT: "a lookaround"}.get(op, str(op).lower()))

    def _class(self, items: list[tuple[Any, Any]]) -> str:
        negated = bool(items) and items[0][0] is sre.NEGATE
        parts = []
        for op, arg in items[1:] if negated else items:
            if op is sre.LITERAL:
                parts.append(self._class_chars(arg, arg, negated))
            elif op is sre.RANGE:
                parts.append(self._class_chars(arg[0], arg[1], negated))
            elif op is sre.CATEGORY and arg in (self._NEGATED_CLASSES if negated else self._CLASSES):
                parts.append((self._NEGATED_CLASSES if negated else self._CLASSES)[arg])
            else:
                raise self._unsupported(f"{str(arg).lower()} in a character class")
        if negated:
            return f'[^{"".join(parts)}"\\\\\\x00-\\x1F]'
        text = "".join(parts)
        if not text:
            raise self._unsupported("a character class of characters a JSON string escapes only")
        return f"[{text}]"

    def _class_chars(self, first: int, last: int, negated: bool) -> str:
        """The range first..last, without what a JSON string must escape (unless negated: then excluded)."""
        spans = [(first, last)] if negated else _split_out(first, last, (0x22, 0x5C), 0x20)
        return "".join(_escape(chr(a), CLASS_SPECIAL) + (f"-{_escape(chr(b), CLASS_SPECIAL)}" if b > a else "")
                       for a, b in spans)


def _split_out(first: int, last: int, holes: tuple[int, ...], floor: int) -> list[tuple[int, int]]:
    """The range first..last from ``floor`` up, without the code points ``holes``."""
    spans, start = [], max(first, floor)
    for hole in sorted(holes):
        if start <= hole <= last:
            if start < hole:
                spans.append((start, hole - 1))
            start = hole + 1
    if start <= last:
        spans.append((start, last))
    return spans
