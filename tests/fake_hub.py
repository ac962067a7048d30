"""A local stand-in for the Hugging Face Hub, speaking the calls huggingface_hub and mpserve make
(``HF_ENDPOINT`` pointed at ``FakeHub.url``):

    GET  /api/models/OWNER/REPO/tree/REV     the repo's files (list_repo_files), with their LFS sha256
    HEAD /OWNER/REPO/resolve/REV/PATH        X-Repo-Commit, X-Linked-Etag (sha256), X-Linked-Size
    GET  /OWNER/REPO/resolve/REV/PATH        the bytes, a Range honoured (206)

Unknown repos, revisions and files answer 404 with the Hub's X-Error-Code. Faults for the tests: ``cut_after``
closes the next body after that many bytes, ``corrupt`` serves a file with a byte changed (its sha256 still the
right one), ``delay_s`` sleeps between chunks so that a download lasts. ``gets`` records each body GET's path and
first byte. A repo in ``private`` is hidden (as unknown) from requests without ``Authorization: Bearer TOKEN``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/?]+)")


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], private: dict[str, str] | None = None) -> None:
        self.repos = repos
        self.private = private or {}  # repo -> the token that may see it
        self.cut_after: int | None = None
        self.corrupt: set[str] = set()
        self.delay_s = 0.0
        self.gets: list[tuple[str, int]] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 (http.server's naming)
                hub._resolve(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/api/"):
                    hub._tree(self)
                else:
                    hub._resolve(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, path: str) -> list[int]:
        """The first byte of each GET of ``path``'s bytes."""
        return [start for got, start in self.gets if got == path]

    def _missing(self, handler: BaseHTTPRequestHandler, repo: str, rev: str, path: str | None) -> bool:
        hidden = repo in self.private and handler.headers.get("Authorization") != f"Bearer {self.private[repo]}"
        code = ("RepoNotFound" if repo not in self.repos or hidden
                else "RevisionNotFound" if rev not in ("main", COMMIT)
                else "EntryNotFound" if path is not None and path not in self.repos[repo] else None)
        if code is None:
            return False
        handler.send_response(401 if code == "RepoNotFound" else 404)  # the Hub's answer for a repo it hides
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return True

    def _tree(self, handler: BaseHTTPRequestHandler) -> None:
        found = _TREE.match(handler.path)
        if found is None:  # huggingface_hub asks for other things too (a registry of agents): not served here
            handler.send_response(404)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        if self._missing(handler, found["repo"], found["rev"], None):
            return
        files = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest(),
                  "lfs": {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}}
                 for name, data in self.repos[found["repo"]].items()]
        body = json.dumps(files).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def _resolve(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        found = _RESOLVE.match(handler.path)
        assert found is not None, handler.path
        repo, path = found["repo"], found["path"]
        if self._missing(handler, repo, found["rev"], path):
            return
        data = self.repos[repo][path]
        sha256 = hashlib.sha256(data).hexdigest()
        if path in self.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        ranged = re.match(r"bytes=(\d+)-", handler.headers.get("Range", ""))
        start = int(ranged.group(1)) if ranged and body else 0
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", COMMIT)
        handler.send_header("X-Linked-Etag", f'"{sha256}"')
        handler.send_header("X-Linked-Size", str(len(data)))
        handler.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("Content-Length", str(len(data) - start))
        if start:
            handler.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        handler.end_headers()
        if not body:
            return
        self.gets.append((path, start))
        cut, self.cut_after = self.cut_after, None
        end = len(data) if cut is None else min(len(data), start + cut)
        for offset in range(start, end, 64 << 10):
            handler.wfile.write(data[offset:min(end, offset + (64 << 10))])
            handler.wfile.flush()
            time.sleep(self.delay_s)  # not a wait: the slow hub this fake plays
        if cut is not None:
            handler.close_connection = True
