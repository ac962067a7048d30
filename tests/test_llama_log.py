"""llama.cpp's log reaches mpserve's as records of ``mpserve.llama`` at their own levels (a failed load's reason
an error), with the lines known to be harmless on every load of a sound model left out."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import RealModel

from mpserve.engine.model_info import free, load_model

pytestmark = [pytest.mark.real, pytest.mark.timeout(120)]


def test_a_gemma_load_logs_no_control_looking_token_line_and_a_failed_load_logs_why(
        real_model: RealModel, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
        tmp_path: Path) -> None:
    import llama_cpp

    llama_cpp.llama_backend_init()
    with caplog.at_level(logging.DEBUG, logger="mpserve.llama"):
        free(llama_cpp, None, load_model(llama_cpp, real_model.path, 0, real_model.repack))
        not_gguf = tmp_path / "not.gguf"
        not_gguf.write_bytes(b"not a model")
        with pytest.raises(ValueError, match="Failed to load model"):
            load_model(llama_cpp, str(not_gguf), 0, False)
    printed = capfd.readouterr()
    assert "control-looking token" not in printed.err + printed.out + caplog.text
    assert [r.levelno for r in caplog.records if "error loading model" in r.getMessage()] == [logging.ERROR]
    assert "error loading model" not in printed.err  # a record, not a print of llama-cpp-python's
