"""The draft-model setting (``speculative: {type: draft, model: PATH}``): how it is spelled in YAML and on the
command line, what the config refuses, and the vocabulary check that runs before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from mpserve.config import loader as config
from mpserve.config.speculative import Speculative, check_draft, parse
from mpserve.errors import ConfigError
from mpserve.models import maker
from mpserve.models.builtin import builtin_model_path
from mpserve.server.layout import check_model, model_request

pytestmark = pytest.mark.timeout(60)


def test_a_draft_model_is_spelled_as_a_mapping_or_draft_colon_path() -> None:
    assert parse("draft:/Models/Small.gguf") == Speculative(type="draft", model="/Models/Small.gguf")
    assert parse({"type": "draft", "model": "s.gguf", "n_max": 3, "sizing": "fixed"}) == Speculative(
        type="draft", model="s.gguf", n_max=3, sizing="fixed")
    for bad, words in [("draft", "needs model"), ({"model": "s.gguf"}, "goes with type draft, not ngram"),
                       ({"type": "draft", "model": "s.gguf", "sizing": "sometimes"}, "allowed: measured, fixed")]:
        with pytest.raises(ValueError, match=words):
            parse(bad)


def test_exact_is_a_boolean_and_on_by_default() -> None:
    assert parse("ngram").exact is True
    assert parse({"type": "ngram", "exact": False}) == Speculative(exact=False)
    for bad in ("no", 0, None):
        with pytest.raises(ValueError, match="exact: got .*, allowed: true, false"):
            parse({"exact": bad})


def test_the_config_refuses_a_missing_draft_file_and_a_draft_for_an_embedding_model(tmp_path: Path) -> None:
    draft = str(builtin_model_path("tiny-draft"))
    built = config.build({}, model={"speculative": f"draft:{draft}"})
    assert built.models[0].speculative == Speculative(type="draft", model=draft)
    flag = config.build({}, model={"speculative": f"{{type: draft, model: {draft}, n_max: 3}}"}).models[0]
    assert flag.speculative == Speculative(type="draft", model=draft, n_max=3)
    with pytest.raises(ConfigError, match="speculative: not a YAML mapping"):
        config.build({}, model={"speculative": "{type: draft"})
    with pytest.raises(ConfigError, match=r"speculative\.model: no such draft model file '/no/such\.gguf'"):
        config.build({}, model={"speculative": "draft:/no/such.gguf"})
    with pytest.raises(ConfigError, match="embedding model generates no tokens to draft"):
        config.build({"models": [{"path": "builtin:tiny-embed", "embedding": True,
                                  "speculative": {"type": "draft", "model": draft}}]})


def test_a_draft_path_in_a_file_is_relative_to_the_file(tmp_path: Path) -> None:
    maker.write_model(tmp_path / "small.gguf", "tiny-draft")
    (tmp_path / "mpserve.yaml").write_text("models:\n  - path: builtin:tiny\n    speculative: {type: draft, model: "
                                          "small.gguf}\n")
    built = config.build(config.load_file(tmp_path / "mpserve.yaml"), base_dir=tmp_path)
    assert built.models[0].speculative is not None and built.models[0].speculative.model == str(tmp_path / "small.gguf")


def test_a_draft_with_another_vocabulary_is_refused_naming_both_models(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = builtin_model_path("tiny"), builtin_model_path("tiny-draft")
    check_draft("tiny", target, draft)  # the same tokenizer
    tokens = maker.vocabulary()
    monkeypatch.setattr(maker, "vocabulary", lambda: [*tokens[:300], maker.Token("▁zz", 3.0, tokens[300].kind),
                                                     *tokens[301:]])
    other = maker.write_model(tmp_path / "other.gguf", "tiny-draft")
    monkeypatch.setattr(maker, "vocabulary", lambda: tokens[:-1])
    shorter = maker.write_model(tmp_path / "shorter.gguf", "tiny-draft")
    with pytest.raises(ValueError, match=f"draft model {other} does not have the vocabulary of {target}: token 300 is "
                                         "'▁zz' against"):
        check_draft("tiny", target, other)
    with pytest.raises(ValueError, match=f"{len(tokens) - 1} tokens against {len(tokens)}"):
        check_draft("tiny", target, shorter)
    (tmp_path / "notes.gguf").write_text("not a model")
    with pytest.raises(ValueError, match="cannot read .*notes.gguf as GGUF"):
        check_draft("tiny", target, tmp_path / "notes.gguf")
    model = config.build({}, model={"speculative": f"draft:{other}"}).models[0]
    with pytest.raises(ConfigError, match="does not have the vocabulary.*same tokenizer"):
        check_model(model_request(model))  # what start, plan and add run before anything starts
