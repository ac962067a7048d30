"""The documentation site builds strictly (no broken link, anchor or page), its generated parts are current and
whole (every setting, error code, wire type, wire field and HTTP route is on them; a stale part fails the build),
and the README stays a front page that links into it."""

from __future__ import annotations

import dataclasses
import fcntl
import html
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import msgpack
import msgspec
import pytest

from mpserve import errors
from mpserve.config import settings
from mpserve.wire import protocol as wire

ROOT = Path(__file__).parents[1]


def _hooks() -> ModuleType:
    """docs/hooks.py loaded as mkdocs loads a hook: its folder on sys.path while it runs (it imports plots.py)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "docs"))
    return module


hooks = _hooks()
plots = hooks.plots


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """The site, built once per run: in a parallel run the first test process to need it builds it under a lock in
    the folder the run's processes share, and the others read that build."""
    if worker_id == "master":  # not parallel: the run's own folder
        return _build(tmp_path_factory.mktemp("site"))
    shared = tmp_path_factory.getbasetemp().parent  # this run's, shared by its test processes
    with (shared / "site.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "site").is_dir():
            _build(shared / "site.building").rename(shared / "site")
    return shared / "site"


def _build(out: Path) -> Path:
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=240)
    assert built.returncode == 0, built.stderr[-4000:]
    return out


def _page(site: Path, name: str) -> str:
    return html.unescape((site / name / "index.html").read_text())


def _section(page: str, anchor: str) -> str:
    """The HTML from the heading with id ``anchor`` to the next heading of its level or above."""
    m = re.search(rf'<h([1-6]) id="{re.escape(anchor)}"', page)
    assert m, f"no heading #{anchor}"
    end = re.compile(rf"<h[1-{m.group(1)}][ >]").search(page, m.end())
    return page[m.start():end.start() if end else None]


def _codes_in_table(section: str) -> set[str]:
    return set(re.findall(r"<td><code>([^<]+)</code></td>", section))


@pytest.mark.timeout(300)
def test_every_setting_is_on_the_configuration_page(site: Path) -> None:
    page = _page(site, "configuration")
    for s in settings.SETTINGS:
        section = _section(page, s.key)
        for shown in (s.flag, s.env, s.yaml, s.default, s.help):
            if shown:
                assert shown in section, f"{s.key}: {shown!r} is not in its section of the configuration page"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["operations", "protocol", "python-client"])
def test_every_error_code_is_on_the_pages_that_list_them(site: Path, name: str) -> None:
    rows = _codes_in_table(_page(site, name))
    assert {code.value for code in errors.ErrorCode} <= rows, f"missing on {name}: run python docs/hooks.py errors"


@pytest.mark.timeout(300)
def test_every_message_type_and_every_field_of_its_body_is_on_the_protocol_page(site: Path) -> None:
    page = _page(site, "protocol")
    for mtype in wire.MsgType:
        assert f"<td>{mtype.name}</td>" in page and f"0x{mtype.value:02x}" in page, mtype.name
    typed = {obj.TYPE for obj in vars(wire).values() if isinstance(obj, type) and isinstance(
        getattr(obj, "TYPE", None), wire.MsgType)}
    documented = {cls.TYPE for cls in hooks.message_classes().values() if hasattr(cls, "TYPE")}
    assert typed <= documented, f"body classes not on the protocol page: {typed - documented}"
    for name, cls in hooks.message_classes().items():
        if name in ("Chunks", "Assigns"):  # arrays of CHUNK and ASSIGN bodies
            continue
        fields = {f.name for f in (msgspec.structs.fields(cls) if issubclass(cls, msgspec.Struct)
                                   else dataclasses.fields(cls))}
        assert fields == _codes_in_table(_section(page, hooks.anchor(cls))), name


@pytest.mark.timeout(30)
def test_each_documented_limit_names_a_field_and_the_id_limit_holds() -> None:
    classes = hooks.message_classes()
    for key in hooks.LIMITS:
        cls_name, field = key.split(".")
        names = [f[0] for f in hooks.wire_fields(classes[cls_name])]
        assert field in names, f"LIMITS names {key}, which is no field"
    frames = wire.encode(wire.Cancel("x" * wire.MAX_ID_CHARS))
    assert wire.decode(frames) == wire.Cancel("x" * wire.MAX_ID_CHARS)
    with pytest.raises(errors.ProtocolError, match="longer than 64"):
        wire.decode(wire.encode(wire.Cancel("x" * (wire.MAX_ID_CHARS + 1))))


# (message type, a valid body, the field, a value just inside the documented limit, one just past it)
PROBES = [
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "x"}, "id", "x" * wire.MAX_ID_CHARS, "x" * (wire.MAX_ID_CHARS + 1)),
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "x"}, "timeout", 0.001, 0.0009),
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "x"}, "params", {"max_tokens": wire.MAX_TOKENS_LIMIT},
     {"max_tokens": wire.MAX_TOKENS_LIMIT + 1}),
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "x"}, "params", {"stop": ["s"] * wire.MAX_STOP_STRINGS},
     {"stop": ["s"] * (wire.MAX_STOP_STRINGS + 1)}),
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "x"}, "params", {"n": wire.MAX_CHOICES}, {"n": wire.MAX_CHOICES + 1}),
    (wire.MsgType.REQUEST, {"id": "r", "prompt": "x"}, "params", {"logprobs": wire.MAX_TOP_LOGPROBS},
     {"logprobs": wire.MAX_TOP_LOGPROBS + 1}),
    (wire.MsgType.EMBED, {"id": "e"}, "texts", ["t"] * wire.MAX_EMBED_INPUTS, ["t"] * (wire.MAX_EMBED_INPUTS + 1)),
    (wire.MsgType.CONTROL, {"id": "c", "op": "scale", "model": "m"}, "max", wire.MAX_INSTANCES, wire.MAX_INSTANCES + 1),
    (wire.MsgType.SLOT_ACTION, {"id": "s", "worker": "w0", "action": "erase"}, "slot", 1023, 1024),
    (wire.MsgType.SLOT_ACTION, {"id": "s", "worker": "w0", "action": "save", "slot": 0}, "filename",
     "f" * wire.MAX_FILENAME_CHARS, "f" * (wire.MAX_FILENAME_CHARS + 1)),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mtype, body, field, inside, past", PROBES)
def test_the_documented_limits_are_the_decoder_s(mtype: wire.MsgType, body: dict[str, object], field: str,
                                                 inside: object, past: object) -> None:
    def decode(value: object) -> object:
        return wire.decode([wire.VERSION, bytes([mtype]), msgpack.packb({**body, field: value})])

    decode(inside)
    with pytest.raises((errors.BadRequest, errors.ProtocolError)):
        decode(past)


@pytest.mark.timeout(300)
def test_every_route_of_the_openapi_document_is_on_the_http_page(site: Path) -> None:
    page = _page(site, "http")
    doc = hooks.openapi_document()
    for path, methods in doc["paths"].items():
        for method in methods:
            assert f"{method.upper()} <code>{path}</code>" in page, (method, path)


@pytest.mark.timeout(300)
def test_the_readme_is_a_front_page_that_links_into_the_docs(site: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert "pip install uv && uv run --locked mpserve start --instances 4" in readme
    assert "```sh\ntests/run\n```" in readme  # the test command, which .ci/run runs as it is
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("tests/run")
    linked = set(re.findall(r"\]\(docs/([a-z/-]+)\.md", readme))
    assert {"getting-started", "concepts/index", "how-it-works/index", "configuration", "protocol", "http",
            "deployment", "operations", "benchmarks"} <= linked
    for name in linked:  # docs/x.md is x/index.html on the site, docs/x/index.md x/index.html
        assert (ROOT / "docs" / f"{name}.md").is_file(), f"README.md links to docs/{name}.md, which is no page"
        assert (site / (f"{name}.html" if name.split("/")[-1] == "index" else f"{name}/index.html")).is_file(), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", [str(p.relative_to(ROOT / "docs")) for p in hooks.pages()])
def test_the_generated_parts_kept_in_each_page_are_current(page: str) -> None:
    text = (ROOT / "docs" / page).read_text()
    assert "--8<--" not in text, f"docs/{page}: a snippet line shows literally on GitHub; use a generated file part"
    assert hooks.stale(text) == [], f"docs/{page}: stale generated parts: run `{hooks.COMMAND}`"


class _Page:
    class file:  # noqa: N801 (the shape of mkdocs' Page.file)
        src_uri = "configuration.md"


@pytest.mark.timeout(60)
def test_a_stale_part_fails_the_strict_build_naming_the_command(caplog: pytest.LogCaptureFixture) -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    first = settings.SETTINGS[0]
    stale = text.replace(f"### {first.key}\n", f"### {first.key}_renamed\n", 1)
    assert stale != text and hooks.stale(stale) == ["settings"]
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        rendered = hooks.on_page_markdown(stale, page=_Page)
    # a warning of an "mkdocs" logger is what --strict counts as a failure
    assert [r.name.split(".")[0] for r in caplog.records] == ["mkdocs"]
    assert "'settings' is stale" in caplog.text and hooks.COMMAND in caplog.text
    assert rendered == text  # the site shows the part as the code makes it
    example = text.replace("max_queue: 128", "max_queue: 64", 1)
    assert example != text and hooks.stale(example) == ["file examples/two_models.yaml"]
    with pytest.raises(ValueError, match="end generated"):
        hooks.render(text.replace("<!-- end generated -->", "", 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", plots.names())
def test_each_result_file_is_plotted_on_the_benchmarks_page_with_its_commands_and_dates(site: Path, name: str) -> None:
    plot = plots.load(name)
    page = _page(site, "benchmarks")
    assert f'src="../plots/{name}.svg"' in page, f"docs/benchmarks.md has no `<!-- generated: plot {name} -->`"
    svg = html.unescape((site / "plots" / f"{name}.svg").read_text())
    assert svg.startswith("<?xml") and "</svg>" in svg and plot.title in svg
    for run in plot.runs:
        assert f"<code>{run.command}</code> (recorded {run.date}, {run.recorded_in})" in page, run.command
        if plot.kind == "bars":
            assert all(line in svg for x in run.x for line in str(x).split("\n")), run.x


@pytest.mark.timeout(60)
def test_each_plot_is_committed_as_drawn_so_github_shows_it(caplog: pytest.LogCaptureFixture,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/benchmarks.md shows `plots/NAME.svg`, a file of the repository (GitHub draws the page from it), drawn
    from its result file; one that differs from what its result file draws now fails the strict build, naming
    the command that draws it again."""
    assert plots.stale_images() == [], f"stale plots: run `{hooks.COMMAND}`"
    for name in plots.names():
        assert (ROOT / "docs" / "plots" / f"{name}.svg").read_text() == plots.svg(plots.load(name))
    monkeypatch.setattr(plots, "IMAGES", tmp_path)
    (tmp_path / "gone.svg").write_text("<svg/>")  # a plot no result file draws
    assert plots.stale_images() == [*plots.names(), "gone"]
    with caplog.at_level(logging.WARNING, logger="mkdocs"):
        plots.on_pre_build(config=None)
    assert caplog.records and all(r.name.split(".")[0] == "mkdocs" for r in caplog.records)
    assert "docs/plots/gone.svg" in caplog.text and hooks.COMMAND in caplog.text
    plots.write_images()
    assert plots.stale_images() == [] and not (tmp_path / "gone.svg").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", plots.names())
def test_every_plotted_figure_is_one_the_benchmark_pages_report(name: str) -> None:
    """A plot draws figures already written down with their runs, never new ones."""
    text = "".join((ROOT / "docs" / page).read_text() for page in ("benchmarks.md", "benchmarks-history.md"))
    for run in plots.load(name).runs:
        for value in [*run.y, *(run.low or []), *(run.high or [])]:
            if value is not None:
                assert {f"{value:.2f}", f"{value:.1f}"} & set(re.findall(r"\d+\.\d+", text)), (run.label, value)


@pytest.mark.timeout(30)
def test_a_result_file_that_breaks_a_rule_is_refused_naming_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    good = {"panel": "p", "label": "l", "command": "python -m bench --only memory", "date": "2026-12-03",
            "recorded_in": "0f46866", "x": [1, 2], "y": [1.0, 2.0]}
    monkeypatch.setattr(plots, "RESULTS", tmp_path)
    for broken, says in [({"panel": "q"}, "panel 'q'"), ({"date": "yesterday"}, "date"),
                         ({"command": "make bench"}, "command"), ({"y": [1.0]}, "one value per point"),
                         ({"x": ["a", "b"]}, "numbers"), ({"seconds": 3}, "seconds")]:
        plot = {"title": "t", "kind": "lines", "xlabel": "", "ylabel": "", "panels": ["p"],
                "runs": [good, {**good, **broken}]}
        (tmp_path / "bad.json").write_text(json.dumps(plot))
        with pytest.raises(ValueError, match=f"docs/results/bad.json: .*{re.escape(says)}"):
            plots.load("bad")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("front", ["README.md", "docs/index.md"])
def test_each_page_of_the_site_s_navigation_is_linked_from_the_front_pages(front: str) -> None:
    """The README's table and the site's home page name each guide and reference page (a section's overview
    stands for its pages), so that none is found only through the site's menu."""
    nav = re.findall(r"^\s+- [^:\n]+: ([\w/-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    pages = {p for p in nav if "/" not in p or p.endswith("/index.md")} - {"index.md"}
    prefix = "docs/" if front == "README.md" else ""
    linked = set(re.findall(rf"\]\({prefix}([\w/-]+\.md)", (ROOT / front).read_text()))
    assert sorted(pages - linked) == [], f"{front} does not link them"


@pytest.mark.timeout(30)
def test_every_argument_a_client_is_made_with_is_on_the_python_client_page() -> None:
    import inspect

    from mpserve.client import AsyncClient, Client

    page = (ROOT / "docs" / "python-client.md").read_text()
    names = {n for cls in (Client, AsyncClient) for n in inspect.signature(cls.__init__).parameters} - {"self"}
    assert sorted(n for n in names if f"`{n}" not in page and f"{n}=" not in page) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", ["getting-started.md", "concepts/failures.md"])
def test_the_pages_a_newcomer_reads_first_say_that_greedy_output_depends_on_the_cache(page: str) -> None:
    """Under `reuse: any` (the default) a temperature-0 request may give other text warm than cold; the pages a
    newcomer meets it on say so, with the setting that makes output reproducible and where its cost is told."""
    text = " ".join((ROOT / "docs" / page).read_text().split())
    assert "`reuse: any`" in text and "--reuse exact`" in text and "exact-output.md" in text


@pytest.mark.timeout(120)
def test_the_quick_start_s_real_model_command_finds_its_gguf_in_a_clone() -> None:
    """The README and Getting started give one command that serves the real model of the lock; the path it hands
    to --model is a GGUF file (the `real` extra is in the test extra), found as the tests find it."""
    commands = [re.search(r"^uv run --locked --extra real mpserve start .*?\n\s+\"\$\((.*?)\)\"$", page, re.M | re.S)
                for page in ((ROOT / "README.md").read_text(), (ROOT / "docs" / "getting-started.md").read_text())]
    assert all(commands) and len({m.group(0) for m in commands if m}) == 1, "the two pages differ or lack it"
    inner = commands[0].group(1) if commands[0] else ""
    assert inner.startswith("uv run --locked --extra real python -c '") and inner.endswith("'")
    found = subprocess.run([sys.executable, "-c", inner.split("-c '", 1)[1][:-1]], capture_output=True, text=True,
                           timeout=100, cwd=ROOT)
    assert found.returncode == 0, found.stderr
    path = Path(found.stdout.strip())
    with path.open("rb") as gguf:
        assert path.suffix == ".gguf" and gguf.read(4) == b"GGUF"
