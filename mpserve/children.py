"""How mpserve starts a Python child: never with its working directory on the child's ``sys.path``.

A child started as ``python -m mpserve`` or ``python -c CODE`` would put the folder it was started from first on
``sys.path``, so a folder named ``mpserve`` (or ``llama_cpp``) there would be imported instead of the installed
package: a clone's parent folder breaks every child, and a shared folder (``/tmp``) lets whoever can write in it
run code as the server's user. Every child is started in the server's working directory (relative paths keep
their meaning), with that directory kept off its path:

    cli (gateway children, an upgrade's exec), repack and llama_build probes ──▶ ``python(*args)``:
        this interpreter with ``-P`` (Python 3.11+), else ``-I`` (isolated: PYTHON* variables and the user's
        site-packages are ignored too)
    the supervisor's fork server (multiprocessing starts it with ``-c``, and ignores the path it is given)
        ──▶ ``keep_off_path()``: ``PYTHONSAFEPATH`` in this process's environment, which the fork server and every
            process after it inherit (Python 3.11+; Python 3.10 has no such variable)
"""

from __future__ import annotations

import os
import sys

SAFE_PATH_FLAG = "-P" if sys.version_info >= (3, 11) else "-I"
SAFE_PATH_ENV = "PYTHONSAFEPATH"


def python(*args: str, executable: str = sys.executable) -> list[str]:
    """The argv of ``executable`` (this interpreter by default) running ``args``, its working directory off its path."""
    return [executable, SAFE_PATH_FLAG, *args]


def keep_off_path() -> None:
    """The Python children that code other than mpserve's starts from this process (multiprocessing's fork server)
    keep their working directory off their path too."""
    os.environ[SAFE_PATH_ENV] = "1"
