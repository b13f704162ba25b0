"""Fetches a PEFT adapter folder from a URI (s3, gs, http(s) through fsspec) into its
tenant's root, content-addressed.

A fetch of `uri` for a tenant:
1. lists the folder (object stores) or asks for each adapter file's size (http), and
   refuses before any download: a missing file (404), more than `max_files` objects
   under the folder or more than `max_bytes` in the adapter's files (413);
2. reuses an earlier download when the listing still shows the same object versions
   (ETag or generation); concurrent fetches of one URI (threads of this process, and
   other processes through a file lock) download it once;
3. downloads the adapter files into `<tenant root>/.fetched/.partial-*`, counting the
   bytes against `max_bytes` and the time against `timeout_s`, with progress in the log;
4. lists the files again: an object replaced meanwhile is refused (409), so no folder
   holds a mix of two versions;
5. names the folder by the SHA-256 of its files (`.fetched/<sha256>`): the same bytes
   give the same folder, wherever they came from, and so the same adapter identity.

Folders no catalog entry names are evicted oldest first once the fetched folders of the
whole adapter root exceed `cache_bytes` (`evict`), never within `EVICTION_GRACE_S` of
their last use (a registration between its fetch and its catalog entry).

Nothing from the remote side reaches an error message unfiltered: errors are fixed
sentences with the URI's display form, and logged text passes `AccessSecrets.scrub`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
from filelock import FileLock, Timeout
from pydantic import BaseModel, ConfigDict, Field

from loraplex.adapters.sources import AdapterUri, SourceAccess
from loraplex.adapters.store import ADAPTER_FILES

logger = logging.getLogger(__name__)

FETCHED_DIR = ".fetched"
PARTIAL_PREFIX = ".partial-"
EVICTION_GRACE_S = 600.0
PROGRESS_EVERY_S = 2.0
MiB = 1 << 20
QUIET_LOGGERS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "fsspec")
"""Libraries whose debug logs carry signed request headers: held at INFO or above."""


class FetchLimits(BaseModel):
    """Bounds on one adapter fetch, and on the fetched folders kept on disk."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_bytes: int = Field(2 << 30, ge=1, description="the adapter files' total size")
    max_files: int = Field(64, ge=2, description="objects under the adapter's folder")
    timeout_s: float = Field(600.0, gt=0, description="one fetch, listing to last byte")
    cache_bytes: int = Field(
        16 << 30, ge=0, description="fetched folders no adapter uses, kept for reuse"
    )
    chunk_bytes: int = Field(4 * MiB, ge=4096, description="bytes per read (and progress)")


class FetchError(Exception):
    """A fetch that failed; `status` is the HTTP status to answer the tenant."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass(frozen=True)
class FetchedAdapter:
    folder: Path
    """`<tenant root>/.fetched/<sha256>`."""
    sha256: str
    size: int
    downloaded: bool
    """False when an earlier download of the same object versions was reused."""

    @property
    def relative(self) -> str:
        """The folder relative to its tenant's root (what the catalog records)."""
        return f"{FETCHED_DIR}/{self.sha256}"


@dataclass(frozen=True)
class _Listing:
    sizes: dict[str, int | None]
    versions: dict[str, str | None]
    """Per adapter file: its ETag, generation or Last-Modified (None: not told)."""

    @property
    def pinned(self) -> bool:
        return all(v is not None for v in self.versions.values())


class AdapterFetcher:
    def __init__(self, limits: FetchLimits) -> None:
        self.limits = limits
        for name in QUIET_LOGGERS:
            library = logging.getLogger(name)
            library.setLevel(max(library.getEffectiveLevel(), logging.INFO))
        self._mutex = threading.Lock()
        self._in_flight: dict[tuple[Path, str], Future[FetchedAdapter]] = {}

    def fetch(self, tenant_root: Path, uri: AdapterUri, access: SourceAccess) -> FetchedAdapter:
        """The adapter at `uri`, downloaded into `tenant_root` (or reused). Blocking: call
        it off the event loop. FetchError for every failure."""
        key = (tenant_root, uri.file(""))
        with self._mutex:
            running = self._in_flight.get(key)
            if running is None:
                own: Future[FetchedAdapter] = Future()
                self._in_flight[key] = own
        if running is not None:
            logger.info("adapter %s: joining a fetch already under way", uri.display)
            try:
                return running.result(timeout=self.limits.timeout_s)
            except TimeoutError:
                raise _still_fetching(uri) from None
        try:
            result = self._fetch_locked(tenant_root, uri, access)
        except BaseException as exc:
            own.set_exception(exc)
            raise
        else:
            own.set_result(result)
            return result
        finally:
            with self._mutex:
                del self._in_flight[key]

    def _fetch_locked(
        self, tenant_root: Path, uri: AdapterUri, access: SourceAccess
    ) -> FetchedAdapter:
        fetched = tenant_root / FETCHED_DIR
        (fetched / ".locks").mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(uri.file("").encode()).hexdigest()[:32]
        try:
            lock = FileLock(str(fetched / ".locks" / digest)).acquire(timeout=self.limits.timeout_s)
        except Timeout:
            raise _still_fetching(uri) from None
        with lock:
            return _Fetch(self.limits, fetched, uri, access, fetched / f".uri-{digest}.json").run()

    def evict(self, adapter_root: Path, in_use: set[Path]) -> list[Path]:
        """Removes fetched folders of every tenant under `adapter_root` that no catalog
        entry names (`in_use`), least recently used first, until the rest fit
        `cache_bytes`; never one used within EVICTION_GRACE_S. Returns the removed."""
        now = time.time()
        folders = [p for p in adapter_root.glob(f"*/{FETCHED_DIR}/*") if _is_content_folder(p)]
        sized = [(p.stat().st_mtime, _folder_bytes(p), p) for p in folders]
        unused = sorted(entry for entry in sized if entry[2] not in in_use)
        total = sum(size for _, size, _ in unused)
        removed = []
        for mtime, size, folder in unused:
            if total <= self.limits.cache_bytes:
                break
            if now - mtime < EVICTION_GRACE_S:
                continue
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
            removed.append(folder)
            logger.info("evicted fetched adapter folder %s (%d bytes, unused)", folder, size)
        return removed


def _still_fetching(uri: AdapterUri) -> FetchError:
    return FetchError(
        503, f"{uri.display}: another fetch of it is still running; retry", "fetch_timeout"
    )


def content_line(name: str, size: int, file_sha256: str) -> bytes:
    """One file's part of a folder's content hash (the folder's name)."""
    return f"{name}\0{size}\0{file_sha256}\n".encode()


def store_files(tenant_root: Path, files: dict[str, bytes]) -> FetchedAdapter:
    """Writes an adapter's files (bytes in hand: a trainer's push) into the tenant's
    content-addressed folders, as a fetch would have named them."""
    fetched = tenant_root / FETCHED_DIR
    fetched.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(dir=fetched, prefix=PARTIAL_PREFIX))
    try:
        content = hashlib.sha256()
        for name in sorted(files):
            data = files[name]
            (partial / name).write_bytes(data)
            content.update(content_line(name, len(data), hashlib.sha256(data).hexdigest()))
        folder = _settle(partial, fetched / content.hexdigest())
        return FetchedAdapter(folder, folder.name, sum(map(len, files.values())), True)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _settle(partial: Path, folder: Path) -> Path:
    """Renames a complete partial folder to its content name; when that folder exists
    already (the same bytes), marks it used and leaves the partial to be removed."""
    try:
        partial.rename(folder)
    except OSError:
        if not _is_content_folder(folder):
            raise
        os.utime(folder)
    return folder


def _is_content_folder(path: Path) -> bool:
    return len(path.name) == 64 and path.is_dir() and not path.is_symlink()


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


class _Fetch:
    """One fetch, under its URI's lock (see the module doc for the steps)."""

    def __init__(
        self,
        limits: FetchLimits,
        fetched: Path,
        uri: AdapterUri,
        access: SourceAccess,
        index: Path,
    ) -> None:
        self.limits = limits
        self.fetched = fetched
        self.uri = uri
        self.access = access
        self.index = index
        self.deadline = time.monotonic() + limits.timeout_s
        self.fs: Any = None

    def run(self) -> FetchedAdapter:
        started = time.monotonic()
        try:
            self.fs = fsspec.filesystem(self.access.protocol, **self.access.storage_options)
            listing = self._listing()
            reused = self._reuse(listing)
            if reused is not None:
                logger.info("adapter %s: unchanged since its last fetch, reused", self.uri.display)
                return reused
            result = self._download(listing)
        except FetchError:
            raise
        except FileNotFoundError:
            # fsspec's http reads every refusal of its HEAD and GET as "not found".
            maybe_denied = (
                ", or the source refused access" if self.access.protocol == "http" else ""
            )
            raise self._failed(
                404, f"{self.uri.display}: no such adapter{maybe_denied}", "adapter_not_found"
            ) from None
        except PermissionError:
            raise self._failed(
                403, f"{self.uri.display}: access denied by the source", "source_denied"
            ) from None
        except TimeoutError:
            raise self._timed_out() from None
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EBUSY:
                # s3fs's FileExpired: the ETag changed between two reads of one file.
                raise self._changed() from None
            logger.warning(
                "adapter %s: fetch failed: %s: %s",
                self.uri.display,
                type(exc).__name__,
                self.access.secrets.scrub(str(exc)),
            )
            raise FetchError(
                503, f"{self.uri.display}: the source could not be read; retry", "source_error"
            ) from None
        logger.info(
            "adapter %s fetched: %d bytes in %.1f s -> %s",
            self.uri.display,
            result.size,
            time.monotonic() - started,
            result.folder,
        )
        return result

    def _failed(self, status: int, message: str, code: str) -> FetchError:
        logger.info("adapter %s not fetched: %s", self.uri.display, message)
        return FetchError(status, message, code)

    def _changed(self) -> FetchError:
        return self._failed(
            409, f"{self.uri.display} changed while it was downloaded; retry", "adapter_changed"
        )

    def _timed_out(self) -> FetchError:
        return self._failed(
            503,
            f"{self.uri.display}: fetching took over {self.limits.timeout_s:g} s; retry",
            "fetch_timeout",
        )

    def _listing(self) -> _Listing:
        """Sizes and versions of the adapter files; refuses before any download."""
        if self.access.protocol == "http":
            infos = {name: self.fs.info(self.uri.file(name)) for name in ADAPTER_FILES}
        else:
            entries = self.fs.ls(self.uri.folder(), detail=True)
            if len(entries) > self.limits.max_files:
                raise self._failed(
                    413,
                    f"{self.uri.display} holds {len(entries)} objects, over the "
                    f"{self.limits.max_files} an adapter folder may hold",
                    "adapter_too_large",
                )
            by_name = {e["name"].rsplit("/", 1)[-1]: e for e in entries if e["type"] == "file"}
            missing = [name for name in ADAPTER_FILES if name not in by_name]
            if missing:
                raise self._failed(
                    404, f"{self.uri.display}: no {', '.join(missing)}", "adapter_not_found"
                )
            infos = {name: by_name[name] for name in ADAPTER_FILES}
        listing = _Listing(
            {name: info.get("size") for name, info in infos.items()},
            {name: _version(info) for name, info in infos.items()},
        )
        known = sum(size or 0 for size in listing.sizes.values())
        if known > self.limits.max_bytes:
            raise self._failed(
                413,
                f"{self.uri.display} is {known} bytes, over the {self.limits.max_bytes} "
                "an adapter may hold",
                "adapter_too_large",
            )
        return listing

    def _reuse(self, listing: _Listing) -> FetchedAdapter | None:
        if not listing.pinned or not self.index.is_file():
            return None
        try:
            record = json.loads(self.index.read_text())
        except (OSError, ValueError):
            return None
        folder = self.fetched / str(record.get("sha256"))
        if record.get("versions") != listing.versions or not _is_content_folder(folder):
            return None
        os.utime(folder)
        return FetchedAdapter(folder, folder.name, int(record["size"]), downloaded=False)

    def _download(self, listing: _Listing) -> FetchedAdapter:
        partial = Path(tempfile.mkdtemp(dir=self.fetched, prefix=PARTIAL_PREFIX))
        try:
            content = hashlib.sha256()
            total = 0
            expected = sum(size or 0 for size in listing.sizes.values())
            for name in ADAPTER_FILES:
                file_hash, size = self._copy(name, partial / name, total, expected)
                content.update(content_line(name, size, file_hash))
                total += size
            if self._listing().versions != listing.versions:
                raise self._changed()
            sha = content.hexdigest()
            folder = _settle(partial, self.fetched / sha)
            self._write_index(sha, total, listing)
            return FetchedAdapter(folder, sha, total, downloaded=True)
        finally:
            shutil.rmtree(partial, ignore_errors=True)

    def _copy(self, name: str, target: Path, done: int, expected: int) -> tuple[str, int]:
        """Copies one file, hashing it; FetchError past `max_bytes` or the deadline."""
        file_hash = hashlib.sha256()
        size = 0
        last_report = time.monotonic()
        chunk = self.limits.chunk_bytes
        with (
            self.fs.open(self.uri.file(name), "rb", block_size=chunk) as source,
            target.open("wb") as out,
        ):
            while data := source.read(chunk):
                size += len(data)
                if done + size > self.limits.max_bytes:
                    raise self._failed(
                        413,
                        f"{self.uri.display} is over the {self.limits.max_bytes} bytes an "
                        "adapter may hold",
                        "adapter_too_large",
                    )
                if time.monotonic() > self.deadline:
                    raise self._timed_out()
                file_hash.update(data)
                out.write(data)
                if time.monotonic() - last_report >= PROGRESS_EVERY_S:
                    last_report = time.monotonic()
                    logger.info(
                        "adapter %s: %.1f of %s MiB fetched",
                        self.uri.display,
                        (done + size) / MiB,
                        f"{expected / MiB:.1f}" if expected else "?",
                    )
        return file_hash.hexdigest(), size

    def _write_index(self, sha: str, size: int, listing: _Listing) -> None:
        if not listing.pinned:
            return
        record = {"sha256": sha, "size": size, "versions": listing.versions}
        partial = self.index.with_suffix(".tmp")
        partial.write_text(json.dumps(record))
        partial.replace(self.index)


def _version(info: dict[str, Any]) -> str | None:
    """What identifies an object's current version in an fsspec listing entry."""
    for field in ("ETag", "etag", "generation", "VersionId", "md5Hash", "LastModified"):
        value = info.get(field)
        if value:
            return str(value)
    return None
