"""Models on the Hugging Face Hub, named as llama-server's ``-hf`` names them, kept in the Hub's standard cache.

    hf://owner/repo[@REV]/path/file.gguf   one file (its split parts with it)
    hf://owner/repo[@REV][:QUANT]          the repo's GGUF of that quantization (default: Q4_K_M, then Q8_0,
    owner/repo[@REV]:QUANT                 then the first), as llama-server's -hf owner/repo:QUANT chooses

    HubRef ──cached()──▶ snapshots/COMMIT/FILE in the cache (no network: refs/REV names the commit)
           ──pull()───▶ lock ─▶ cached? ─▶ list the repo (a QUANT) ─▶ HEAD each file (commit, sha256, size)
                                 ─▶ download.download (resume, sha256) ─▶ blobs/SHA256, a link in snapshots/COMMIT/
           ──pull_projector()──▶ the model pulled ─▶ its projector cached? (``cached_projector``) ─▶ list the repo
                                 ─▶ ``choose_projector``: the mmproj GGUF beside the model ─▶ fetched as above

The cache is huggingface_hub's (``HF_HUB_CACHE``, ``HF_HOME``): files pulled here serve ``hf_hub_download`` and
the other way round. ``HF_TOKEN`` authorises private and gated repos, ``HF_ENDPOINT`` names another Hub, and
``HF_HUB_OFFLINE=1`` serves from the cache only. ``pull`` holds a host-wide file lock per file, so servers
starting at once download it once: the others wait and then find it cached.
"""

from __future__ import annotations

import fcntl
import logging
import os
import posixpath
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from mpserve.errors import ConfigError, ConnectionFailed, MpserveError

from .download import ConnectionLost, DownloadError, download
from .progress import Progress

log = logging.getLogger("mpserve.hub")

PREFIX = "hf://"
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # llama-server's choice when no quantization is named, in order
PROJECTOR_TYPES = ("F16", "BF16", "F32", "Q8_0")  # of a repo's several projectors, the first of these it has
_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[^:/@]+))?(?::(?P<quant>[A-Za-z0-9_.-]+))?$")
_FILE = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?:@(?P<rev>[^:/@]+))?/(?P<file>.+\.gguf)$", re.IGNORECASE)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_ETAG = re.compile(r"^[0-9a-f]{40}$|^[0-9a-f]{64}$")  # a blob's git sha1 or, for an LFS file, its sha256
FORMS = "hf://OWNER/REPO/FILE.gguf, hf://OWNER/REPO[:QUANT] or OWNER/REPO:QUANT (@REVISION after the repo if not main)"


@dataclass(frozen=True)
class HubRef:
    """A model on the Hub: ``filename`` named, or chosen by ``quant``."""

    repo: str
    revision: str = "main"
    filename: str | None = None
    quant: str | None = None

    def __str__(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"{PREFIX}{self.repo}{rev}/{self.filename}" if self.filename else \
            f"{self.repo}{rev}:{self.quant or DEFAULT_QUANTS[0]}"


def parse(spec: str) -> HubRef | None:
    """The Hub model ``spec`` names, or None when it names none (a file path, builtin:, echo, ...): ``hf://...``
    always, ``owner/repo:QUANT`` when no such file exists here. A malformed ``hf://`` is a ConfigError."""
    if spec.startswith(PREFIX):
        rest = spec[len(PREFIX):]
        found = _FILE.match(rest) or _REPO.match(rest)
        if found is None:
            raise ConfigError(f"{spec!r} is not a Hub model; write {FORMS}")
    else:
        found = _REPO.match(spec)
        if found is None or found.group("quant") is None or os.path.exists(spec):
            return None
    groups = found.groupdict()
    revision = groups.get("rev") or "main"
    for what, text in (("revision", revision), ("file", groups.get("file") or "")):
        if text and not _inside(text):
            raise ConfigError(f"{spec!r}: its {what} {text!r} leaves the repo (a '..', '.' or empty segment, a "
                              "leading '/' or a backslash); name a file inside it, as the Hub lists them")
    return HubRef(groups["repo"], revision, groups.get("file"), groups.get("quant"))


def _inside(path: str) -> bool:
    """``path`` (a file in a repo, a revision) names something under the repo's snapshot folder and nothing
    outside it."""
    return "\\" not in path and "\0" not in path and all(part not in ("", ".", "..") for part in path.split("/"))


def repo_without_quant(spec: str) -> str | None:
    """What to write instead, when ``spec`` reads as a Hub repo named without its quantization
    (``OWNER/REPO``, no such file here); None otherwise."""
    found = _REPO.match(spec)
    if found is None or found.group("quant") is not None or os.path.exists(spec) or spec.lower().endswith(".gguf"):
        return None  # a .gguf name is a file's
    return (f"{spec!r} is no file here; if it is a repo on the Hugging Face Hub, name its quantization, "
            f"{spec}:{DEFAULT_QUANTS[0]} (or :{DEFAULT_QUANTS[1]}, ...), or a file of it, hf://{spec}/FILE.gguf")


def choose(files: Sequence[str], quant: str | None) -> str:
    """The GGUF of ``files`` (a repo's paths) that ``quant`` names, as llama-server chooses it: the file whose
    name holds the quantization (case aside), its first part if split; no quant: Q4_K_M, then Q8_0, then the
    first GGUF. Projector files (mmproj) are not models. ValueError naming what the repo has when none fits."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in f.lower()
                   and (_PART.search(f) is None or _PART.search(f).group(1) == "00001"))  # type: ignore[union-attr]
    if not ggufs:
        raise ValueError("it has no GGUF files")
    for wanted in (quant,) if quant else DEFAULT_QUANTS:
        pattern = re.compile(rf"(^|[-._/]){re.escape(wanted)}([-._]|$)", re.IGNORECASE)
        named = [f for f in ggufs if pattern.search(_PART.sub(".gguf", f)[:-len(".gguf")])]
        if named:
            return named[0]
    if quant:
        raise ValueError(f"it has no {quant} GGUF; its GGUF files: {', '.join(ggufs)}")
    return ggufs[0]


def parts(filename: str) -> list[str]:
    """The files of a model: ``filename`` alone, or every part of a split GGUF (``-00001-of-0000N``)."""
    found = _PART.search(filename)
    if found is None:
        return [filename]
    count, stem = int(found.group(2)), filename[:found.start()]
    return [f"{stem}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]


def cached(ref: HubRef) -> Path | None:
    """The model's first file in the cache, every part present; None when not (all) there. No network."""
    snapshot = _snapshot(ref)
    if snapshot is None:
        return None
    if ref.filename is not None:
        filename = ref.filename
    else:
        try:
            filename = choose([str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")], ref.quant)
        except ValueError:
            return None
    return snapshot / filename if all((snapshot / p).is_file() for p in parts(filename)) else None


def pull(ref: HubRef) -> Path:
    """The model's first file, downloaded (with its other parts) unless cached; otherwise ConnectionFailed when
    the Hub cannot be reached (or the connection is lost too often), ConfigError naming what else is wrong (an
    unknown repo, revision or file, a checksum mismatch)."""
    from huggingface_hub import constants

    with _locked(re.sub(r"[^A-Za-z0-9._-]", "_", str(ref).removeprefix(PREFIX)), str(ref)):
        found = cached(ref)
        if found is not None:
            return found
        if constants.is_offline_mode():
            raise ConfigError(f"{ref} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              "HF_HUB_OFFLINE is set; pull it where the Hub can be reached (mpserve pull "
                              f"{ref}), or unset HF_HUB_OFFLINE")
        with _asking(ref):
            filename = ref.filename or _choose_online(ref)
            for part in parts(filename):
                _fetch(ref, part)
    found = cached(ref)
    if found is None:
        raise ConfigError(f"{ref}: downloaded, yet not found in the cache ({constants.HF_HUB_CACHE})")
    return found


def choose_projector(files: Sequence[str], model: str) -> str | None:
    """The projector of ``files`` (a repo's paths) that goes with its GGUF ``model``: a GGUF whose name holds
    "mmproj", in the model's folder; of several, the first that PROJECTOR_TYPES names (F16, then BF16, F32, Q8_0),
    else the first by name. None when the folder has none."""
    folder = posixpath.dirname(model)
    found = sorted(f for f in files if posixpath.dirname(f) == folder and f.lower().endswith(".gguf")
                   and "mmproj" in posixpath.basename(f).lower())
    for wanted in PROJECTOR_TYPES:
        pattern = re.compile(rf"(^|[-._]){wanted}([-._]|$)", re.IGNORECASE)
        named = [f for f in found if pattern.search(posixpath.basename(f)[:-len(".gguf")])]
        if named:
            return named[0]
    return found[0] if found else None


def cached_projector(ref: HubRef) -> Path | None:
    """The projector beside the model in the cache (``choose_projector`` among the files there); None when the model
    or its projector is not there. No network."""
    model, snapshot = cached(ref), _snapshot(ref)
    if model is None or snapshot is None:
        return None
    chosen = choose_projector([str(p.relative_to(snapshot)) for p in snapshot.rglob("*.gguf")],
                              str(model.relative_to(snapshot)))
    return snapshot / chosen if chosen is not None else None


def pull_projector(ref: HubRef) -> Path:
    """The model's projector (the model pulled first), downloaded unless cached: the repo's ``choose_projector``;
    ConfigError when the repo has none beside the model, otherwise as ``pull``."""
    from huggingface_hub import HfApi, constants

    model = pull(ref)
    with _locked(re.sub(r"[^A-Za-z0-9._-]", "_", str(ref).removeprefix(PREFIX)) + ".mmproj", f"{ref}'s projector"):
        found = cached_projector(ref)
        if found is not None:
            return found
        if constants.is_offline_mode():
            raise ConfigError(f"{ref}'s projector is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                              "HF_HUB_OFFLINE is set; pull it where the Hub can be reached, or unset HF_HUB_OFFLINE")
        snapshot = _snapshot(ref)
        if snapshot is None:
            raise ConfigError(f"{ref}: pulled, yet its snapshot is not in the cache ({constants.HF_HUB_CACHE})")
        beside = str(model.relative_to(snapshot))
        with _asking(ref):
            chosen = choose_projector(HfApi().list_repo_files(ref.repo, revision=ref.revision), beside)
            if chosen is None:
                raise ConfigError(f"{ref}: its repo has no projector (a GGUF named mmproj*) beside {beside}; give "
                                  "mmproj a file")
            if not _inside(chosen):
                raise ConfigError(f"{ref}: the Hub listed a file {chosen!r} outside the repo; is HF_ENDPOINT a "
                                  "Hugging Face Hub?")
            _fetch(ref, chosen)
    found = cached_projector(ref)
    if found is None:
        raise ConfigError(f"{ref}: its projector downloaded, yet not found in the cache ({constants.HF_HUB_CACHE})")
    return found


@contextmanager
def _asking(ref: HubRef) -> Iterator[None]:
    """What goes wrong asking the Hub about ``ref``, in a user's words: ConnectionFailed when it cannot be reached (or
    the connection is lost too often), ConfigError naming what else is wrong."""
    try:
        yield
    except ConnectionLost as exc:
        raise ConnectionFailed(f"{ref}: {exc}") from None
    except DownloadError as exc:
        raise ConfigError(f"{ref}: {exc}") from None
    except Exception as exc:  # huggingface_hub's and httpx's errors
        raise _explained(ref, exc) from None


def _choose_online(ref: HubRef) -> str:
    from huggingface_hub import HfApi

    files = HfApi().list_repo_files(ref.repo, revision=ref.revision)
    try:
        chosen = choose(files, ref.quant)
    except ValueError as exc:
        raise ConfigError(f"{ref}: {exc}") from None
    if not _inside(chosen):
        raise ConfigError(f"{ref}: the Hub listed a file {chosen!r} outside the repo; is HF_ENDPOINT a Hugging Face "
                          "Hub?")
    return chosen


def _fetch(ref: HubRef, filename: str) -> None:
    """One file into the cache: HEAD for its commit, sha256 and size, the blob downloaded unless present, then
    the snapshot's link and the revision's ref."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils._headers import build_hf_headers

    meta = get_hf_file_metadata(hf_hub_url(ref.repo, filename, revision=ref.revision))
    if meta.commit_hash is None or meta.etag is None or meta.size is None:
        raise ConfigError(f"{ref}: the Hub's answer for {filename} lacks its commit, etag or size; is HF_ENDPOINT "
                          "a Hugging Face Hub?")
    if not _COMMIT.match(meta.commit_hash) or not _ETAG.match(meta.etag):
        raise ConfigError(f"{ref}: the Hub's answer for {filename} names a commit {meta.commit_hash!r} or etag "
                          f"{meta.etag!r} that is not hexadecimal; is HF_ENDPOINT a Hugging Face Hub?")
    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo, repo_type="model")
    blob = storage / "blobs" / meta.etag
    link = storage / "snapshots" / meta.commit_hash / filename
    with _locked(meta.etag, filename):  # the same file under another name (a quant, a path) is pulled once too,
        if not blob.is_file():  # and its link made once
            sha256 = meta.etag if re.fullmatch(r"[0-9a-f]{64}", meta.etag) else None  # an LFS etag is the sha256
            download(meta.location, build_hf_headers(), blob, meta.size, sha256, Progress(filename))
        if not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)  # a dangling link
            link.symlink_to(os.path.relpath(blob, link.parent))
    if ref.revision != meta.commit_hash:
        (storage / "refs").mkdir(exist_ok=True)
        _replace_text(storage / "refs" / ref.revision, meta.commit_hash)


def _replace_text(path: Path, text: str) -> None:
    """``path`` holds ``text``, written whole (another pull may be reading it at the same moment)."""
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(text)
    os.replace(part, path)


def _snapshot(ref: HubRef) -> Path | None:
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=ref.repo, repo_type="model")
    if _COMMIT.match(ref.revision):
        commit = ref.revision
    else:
        try:
            commit = (storage / "refs" / ref.revision).read_text().strip()
        except OSError:
            return None
    snapshot = storage / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


@contextmanager
def _locked(key: str, what: str) -> Iterator[None]:
    """A host-wide lock named ``key`` (a model, a blob), in the cache's own lock folder; says so, naming
    ``what``, when another process holds it."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / ".locks" / "mpserve"
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / f"{key}.lock").open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s: another process is downloading it; waiting", what)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _explained(ref: HubRef, exc: Exception) -> MpserveError:
    """``exc`` (from huggingface_hub or httpx) as a user reads it: what is wrong with ``ref`` and the fix; a
    Hub that cannot be reached is ConnectionFailed, the rest ConfigError."""
    import httpx
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(exc, MpserveError):
        return exc
    if isinstance(exc, GatedRepoError):
        return ConfigError(f"{ref.repo} is a gated repo: accept its terms on the Hub and set HF_TOKEN to a token of "
                           "that account")
    if isinstance(exc, RepositoryNotFoundError):
        return ConfigError(f"no repo {ref.repo} on the Hub ({constants.ENDPOINT}); check its name, or set HF_TOKEN "
                           "if it is private")
    if isinstance(exc, RevisionNotFoundError):
        return ConfigError(f"{ref.repo} has no revision {ref.revision!r}; give a branch, tag or commit of it")
    if isinstance(exc, EntryNotFoundError):
        return ConfigError(f"{ref.repo} has no file {ref.filename!r} at {ref.revision}; mpserve pull "
                           f"{ref.repo}:QUANT chooses one")
    if isinstance(exc, httpx.TransportError):
        return ConnectionFailed(f"cannot reach the Hub ({constants.ENDPOINT}) for {ref}: {exc}; try again, or set "
                                "HF_HUB_OFFLINE=1 to serve what the cache holds")
    if isinstance(exc, HfHubHTTPError):
        return ConfigError(f"the Hub refused {ref}: {exc}".splitlines()[0])
    raise exc
