"""A zygote's listening socket (``mpserve.worker.zygote``): the file it bound is removed when it stops listening,
and only that file: a later zygote of the model that bound the path anew keeps its own."""

from __future__ import annotations

import os
from pathlib import Path

from mpserve.worker.zygote import _listen, _unlisten


def test_a_zygote_that_stops_listening_removes_its_socket_file(tmp_path: Path) -> None:
    path = str(tmp_path / "z.sock")
    listener = _listen(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    _unlisten(listener, path)
    assert not os.path.exists(path)


def test_it_leaves_the_file_a_later_zygote_bound_at_the_same_path(tmp_path: Path) -> None:
    path = str(tmp_path / "z.sock")
    first = _listen(path)
    second = _listen(path)  # the model's next zygote: the path bound anew
    _unlisten(first, path)
    assert os.path.exists(path)
    _unlisten(second, path)
    assert not os.path.exists(path)
