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
    ``mpserve start``, first ──▶ ``check_importable()``: a child started as the fork server is asked where it imports
        mpserve from; another folder than this process's (a folder named mpserve earlier on its path: PYTHONPATH, the
        working directory on Python 3.10), or none (a server run from a source folder, not installed), ends the start
        with one line naming both, instead of zygotes and workers that die as they start
"""

from __future__ import annotations

import os
import subprocess
import sys

from mpserve.errors import ConfigError

SAFE_PATH_FLAG = "-P" if sys.version_info >= (3, 11) else "-I"
SAFE_PATH_ENV = "PYTHONSAFEPATH"
PROBE = "import mpserve; print(next(iter(mpserve.__path__)))"  # a folder without __init__.py has no __file__
PROBE_TIMEOUT_S = 30.0


def python(*args: str, executable: str = sys.executable) -> list[str]:
    """The argv of ``executable`` (this interpreter by default) running ``args``, its working directory off its path."""
    return [executable, SAFE_PATH_FLAG, *args]


def keep_off_path() -> None:
    """The Python children that code other than mpserve's starts from this process (multiprocessing's fork server)
    keep their working directory off their path too."""
    os.environ[SAFE_PATH_ENV] = "1"


def check_importable(timeout: float = PROBE_TIMEOUT_S) -> None:
    """``ConfigError``, in one line, unless a child started as the fork server is (``-c``, this environment with
    ``keep_off_path``) imports mpserve from this process's own package folder. A child that takes too long is left
    to say for itself what is wrong."""
    own = os.path.dirname(os.path.realpath(__file__))
    try:
        done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, SAFE_PATH_ENV: "1"},
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return
    found = done.stdout.strip()
    if done.returncode == 0 and os.path.realpath(found) == own:
        return
    lines = done.stderr.strip().splitlines()
    imports = f"import mpserve from {found}" if done.returncode == 0 else \
        f"cannot import mpserve ({lines[-1] if lines else f'exit status {done.returncode}'})"
    raise ConfigError(f"the server's processes would {imports}, not from this server's {own}: install mpserve "
                      "where they find it (pip install), or take the folder named mpserve off PYTHONPATH"
                      f"{'' if sys.version_info >= (3, 11) else ' or start from another folder'}")
