"""One file over HTTP into place: resumed where an earlier try stopped, checked against its sha256, moved into
place only when whole and right.

    url ──GET (Range: bytes=N- when TARGET.incomplete holds N bytes)──▶ TARGET.incomplete ──sha256 equal──▶ TARGET
          a lost connection: GET again from where it stopped (RETRIES times)       └─differs──▶ DownloadError,
                                                                                     the bytes kept, never served

A partial file stays for the next try, which resumes it (a server that ignores Range starts it again). A whole
file whose checksum differs also stays, under its ``.incomplete`` name, so nothing serves it; the next try starts
it afresh.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from .progress import Progress

log = logging.getLogger("mpserve.download")

RETRIES = 5  # connections lost in a row before the download gives up (the partial file stays)
_CHUNK = 1 << 20
_TIMEOUT_S = 30.0  # seconds without a byte before the connection counts as lost


class DownloadError(Exception):
    """A download that did not end with the right file in place; ``str`` says why and what to do."""


class ConnectionLost(DownloadError):
    """The connection was lost more than ``RETRIES`` times in a row: the network, not the file."""


def partial_path(target: Path) -> Path:
    return target.with_name(target.name + ".incomplete")


def download(url: str, headers: dict[str, str], target: Path, size: int, sha256: str | None,
             progress: Progress) -> None:
    """``url`` into ``target``: ``size`` bytes whose sha256 is ``sha256`` (None: not checked)."""
    partial = partial_path(target)
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have >= size:  # a whole file refused before (its checksum): start again
        partial.unlink()
        have = 0
    try:
        digest = _receive_all(url, headers, partial, size, have, progress)
    finally:
        progress.close()
    if sha256 is not None and digest.hexdigest() != sha256:
        raise DownloadError(f"checksum mismatch: the file's sha256 is {digest.hexdigest()}, the Hub's {sha256}; "
                            f"the bytes are kept in {partial}, never served; run the same command again to "
                            "download it afresh")
    progress.finish()
    partial.rename(target)


def _receive_all(url: str, headers: dict[str, str], partial: Path, size: int, have: int,
                 progress: Progress) -> hashlib._Hash:
    """The rest of the file, from byte ``have`` on, appended to ``partial``; the whole file's digest. A lost
    connection is taken up again from where it stopped."""
    import httpx
    from huggingface_hub import get_session, hf_raise_for_status

    digest = hashlib.sha256()
    with partial.open("ab") as file:
        _hash_existing(partial, have, digest)
        progress.start(size, have)
        lost = 0
        while have < size:
            try:
                ranged = {**headers, "Range": f"bytes={have}-"} if have else headers
                with get_session().stream("GET", url, headers=ranged, follow_redirects=True,
                                          timeout=_TIMEOUT_S) as response:
                    hf_raise_for_status(response)
                    if have and response.status_code != 206:  # the server sent it all: start again
                        file.truncate(0)
                        digest, have = hashlib.sha256(), 0
                        progress.start(size)
                    have = _receive(response.iter_bytes(), file, digest, progress, have, size)
                    if have < size:
                        raise httpx.RemoteProtocolError("the server closed the response early")
                lost = 0
            except httpx.TransportError as exc:
                have = file.tell()  # what reached the file before the connection was lost
                lost += 1
                if lost > RETRIES:
                    raise ConnectionLost(f"the connection was lost {lost} times in a row, the last at {have} of "
                                         f"{size} bytes ({exc}); the {have} bytes are kept in {partial}: run the "
                                         "same command again to resume") from None
                log.warning("%s: connection lost at %d of %d bytes (%s); resuming", progress.name, have, size, exc)
                time.sleep(min(0.2 * 2 ** lost, 5.0))
    return digest


def _receive(chunks: Iterator[bytes], file: BinaryIO, digest: hashlib._Hash, progress: Progress, have: int,
             size: int) -> int:
    """Append ``chunks`` to ``file`` (never past ``size``); the bytes now held."""
    for chunk in chunks:
        chunk = chunk[:size - have]
        file.write(chunk)
        file.flush()
        digest.update(chunk)
        have += len(chunk)
        progress.advance(len(chunk))
    return have


def _hash_existing(path: Path, length: int, digest: hashlib._Hash) -> None:
    """Feed the first ``length`` bytes of ``path`` (a partial download being resumed) to ``digest``."""
    with path.open("rb") as file:
        left = length
        while left:
            block = file.read(min(_CHUNK, left))
            if not block:
                break
            digest.update(block)
            left -= len(block)
