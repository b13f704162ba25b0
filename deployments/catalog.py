"""Which adapters exist, whose they are, and where their files live.

Two kinds of adapter:
- shared: declared per base model in serve_config.yaml (`models[].adapters`), owned by
  the operator; tenants reach them through their `shared_adapters` ACL;
- tenant-owned: registered at runtime through the admin API from a folder under
  `<adapter_root>/<tenant>/`; only their tenant sees them.

Tenant registrations live in `<adapter_root>/.catalog.json`, written atomically under
a file lock, so every ingress and model-server replica (on any node that mounts the
root at the same path) reads the same catalog; a replica re-reads it when its mtime
changes. A node that lacks the shared root says so in its log (a root it had to create,
a tenant adapter asked for where no catalog exists). Each entry has a version that grows
on every register / unload, and the Serve multiplexed model id (`AdapterEntry.model_id`)
includes it: a re-registered or unloaded adapter gets a new id, so no replica serves a
stale copy under the current name.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from loraplex.adapters.fetch import FETCHED_DIR
from loraplex.adapters.store import ADAPTER_FILES, ADAPTER_NAME

logger = logging.getLogger(__name__)

SHARED = "shared"
CATALOG_FILE = ".catalog.json"


class CatalogError(Exception):
    """A registration that cannot be accepted; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterEntry:
    owner: str
    base: str
    name: str
    folder: Path
    version: int = 0
    root: Path | None = None
    """The owner's adapter root for a tenant adapter (its files are read under it without
    following links, and its copy is pinned to `version`); None for shared adapters."""
    source: str | None = None
    """The URI its files were fetched from (display form, no query); None: a folder."""

    @property
    def model_id(self) -> str:
        """Serve multiplexed model id: unique per owner, name and version."""
        return f"{self.owner}/{self.name}@{self.version}"

    @property
    def public_id(self) -> str:
        return f"{self.base}:{self.name}"


def contained_folder(root: Path, relative: str) -> Path:
    """`root / relative` resolved (symlinks followed); CatalogError unless it is a
    directory inside `root` whose adapter files also resolve inside `root`: no absolute
    paths, no '..', no symlink (folder or file) leaving the root."""
    if not relative or Path(relative).is_absolute() or "\x00" in relative:
        raise CatalogError(400, f"adapter path {relative!r} must be relative to your adapter root")
    if root.is_symlink():
        raise CatalogError(400, "your adapter root is a symbolic link; it must be a directory")
    root = root.resolve()
    folder = (root / relative).resolve()
    if not folder.is_relative_to(root) or folder == root:
        raise CatalogError(400, f"adapter path {relative!r} leaves your adapter root")
    if not folder.is_dir():
        raise CatalogError(400, f"adapter path {relative!r} is not a directory")
    for name in ADAPTER_FILES:
        if not (folder / name).resolve().is_relative_to(root):
            raise CatalogError(400, f"{relative}/{name} is a link that leaves your adapter root")
    return folder


class AdapterCatalog:
    def __init__(self, root: str | Path, shared: dict[str, dict[str, str]]) -> None:
        """`shared`: base model -> {adapter name -> folder} from the config."""
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            logger.warning(
                "adapter root %s did not exist on this node (%s); creating it empty "
                "(expected on a first start; on a cluster every node must mount the same "
                "shared folder here, or tenant adapters registered elsewhere are not found)",
                self.root,
                socket.gethostname(),
            )
        self.root.mkdir(parents=True, exist_ok=True)
        self._file = self.root / CATALOG_FILE
        self._lock = FileLock(str(self.root / (CATALOG_FILE + ".lock")))
        self._mutex = threading.Lock()
        self.shared = {
            base: {
                name: AdapterEntry(SHARED, base, name, Path(folder).resolve())
                for name, folder in adapters.items()
            }
            for base, adapters in shared.items()
        }
        self._stamp: tuple[int, int, int] | None = None
        """The catalog file's (inode, size, mtime) when it was last read."""
        self._data: dict = {"next_version": 1, "tenants": {}}

    # ---- reading ---------------------------------------------------------------------
    def _refresh(self, force: bool = False) -> bool:
        """Re-reads the catalog file if it changed (or `force`); True when it did. A
        change is a new (inode, size, mtime): every write replaces the file, but two
        writes within one tick of the file system's clock can share an mtime."""
        try:
            found = self._file.stat()
            stamp = (found.st_ino, found.st_size, found.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        with self._mutex:
            if stamp == self._stamp and not force:
                return False
            self._data = self._read() if stamp is not None else {"next_version": 1, "tenants": {}}
            self._stamp = stamp
            return True

    def reread(self) -> None:
        """Reads the catalog file again whatever its stamp says (a replica reported a
        version this copy still calls current)."""
        self._refresh(force=True)

    def _read(self) -> dict:
        return json.loads(self._file.read_text())

    def tenant_entries(self, tenant: str) -> list[AdapterEntry]:
        """The tenant's usable adapters (entries whose files broke are logged, skipped)."""
        self._refresh()
        entries = []
        for key, record in sorted(self._data["tenants"].get(tenant, {}).items()):
            try:
                entries.append(self._entry(tenant, key, record))
            except CatalogError as exc:
                logger.warning("tenant %s adapter %s skipped: %s", tenant, key, exc)
        return entries

    def _entry(self, tenant: str, key: str, record: dict, check: bool = True) -> AdapterEntry:
        """The entry with its folder checked again: files may have changed since. The
        folder stays the recorded path under the tenant's root (no links resolved): the
        model server reads it without following links, whatever happens after this."""
        base, name = key.split(":", 1)
        root = self.tenant_root(tenant)
        if check:
            contained_folder(root, record["path"])
        return AdapterEntry(
            tenant, base, name, root / record["path"], record["version"], root, record.get("source")
        )

    def model_ids(self, base: str) -> list[str]:
        """The multiplexed model ids of every adapter of `base` the catalog holds now,
        shared and tenant-owned (the disk tier of the residency view; files not checked)."""
        self._refresh()
        ids = [entry.model_id for entry in self.shared.get(base, {}).values()]
        for tenant, records in self._data["tenants"].items():
            for key, record in records.items():
                if key.split(":", 1)[0] == base:
                    ids.append(self._entry(tenant, key, record, check=False).model_id)
        return sorted(ids)

    def find_tenant(self, tenant: str, base: str, name: str) -> AdapterEntry | None:
        self._refresh()
        record = self._data["tenants"].get(tenant, {}).get(f"{base}:{name}")
        return None if record is None else self._entry(tenant, f"{base}:{name}", record)

    def find(self, owner: str, base: str, name: str) -> AdapterEntry | None:
        """The current entry of `owner`'s adapter (SHARED: the operator's)."""
        if owner == SHARED:
            return self.find_shared(base, name)
        return self.find_tenant(owner, base, name)

    def find_shared(self, base: str, name: str) -> AdapterEntry | None:
        return self.shared.get(base, {}).get(name)

    def by_model_id(self, base: str, model_id: str) -> AdapterEntry | None:
        """The current entry a multiplexed model id names (None if deleted or stale)."""
        owner, _, rest = model_id.partition("/")
        name, _, _ = rest.rpartition("@")
        entry = self.find(owner, base, name)
        if entry is None and owner != SHARED and self._stamp is None:
            logger.warning(
                "tenant adapter %s asked for, but this node (%s) sees no catalog %s: is the "
                "shared adapter root mounted here?",
                model_id,
                socket.gethostname(),
                self._file,
            )
        return entry if entry is not None and entry.model_id == model_id else None

    def tenant_root(self, tenant: str) -> Path:
        return self.root / tenant

    # ---- writing (admin API) -------------------------------------------------------------
    def checked_folder(self, tenant: str, relative_path: str) -> Path:
        """The folder a tenant's registration names, refused unless inside its root."""
        tenant_root = self.tenant_root(tenant)
        tenant_root.mkdir(parents=True, exist_ok=True)
        return contained_folder(tenant_root, relative_path)

    def fetched_in_use(self) -> set[Path]:
        """The fetched folders (`<tenant>/.fetched/<sha256>`) some entry names now."""
        self._refresh()
        return {
            self.tenant_root(tenant) / record["path"]
            for tenant, records in self._data["tenants"].items()
            for record in records.values()
            if record["path"].startswith(f"{FETCHED_DIR}/")
        }

    def register(
        self,
        tenant: str,
        base: str,
        name: str,
        relative_path: str,
        max_adapters: int,
        source: str | None = None,
        replace_only: bool = False,
    ) -> AdapterEntry:
        """Records the adapter (a new version when the name exists); `replace_only`: 404
        unless it exists (an update)."""
        if not ADAPTER_NAME.match(name):
            raise CatalogError(
                400, f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        tenant_root = self.tenant_root(tenant)
        folder = self.checked_folder(tenant, relative_path)
        with self._lock:
            data = self._read() if self._file.exists() else {"next_version": 1, "tenants": {}}
            records = data["tenants"].setdefault(tenant, {})
            key = f"{base}:{name}"
            if replace_only and key not in records:
                raise CatalogError(404, f"adapter {key} does not exist")
            if key not in records and len(records) >= max_adapters:
                raise CatalogError(403, f"tenant {tenant!r} may register {max_adapters} adapters")
            version = data["next_version"]
            data["next_version"] = version + 1
            records[key] = {
                "path": str(folder.relative_to(tenant_root.resolve())),
                "version": version,
            }
            if source is not None:
                records[key]["source"] = source
            self._write(data)
        logger.info(
            "tenant %s registered adapter %s -> %s (v%d%s)",
            tenant,
            key,
            folder,
            version,
            f", from {source}" if source else "",
        )
        return AdapterEntry(tenant, base, name, folder, version, tenant_root, source)

    def unload(self, tenant: str, base: str, name: str) -> AdapterEntry:
        """Gives the adapter a new version: replicas drop their copies, the next request
        loads it from disk again."""
        with self._lock:
            data = self._read() if self._file.exists() else {"next_version": 1, "tenants": {}}
            record = data["tenants"].get(tenant, {}).get(f"{base}:{name}")
            if record is None:
                raise CatalogError(404, f"adapter {base}:{name} does not exist")
            record["version"] = data["next_version"]
            data["next_version"] += 1
            self._write(data)
        return self._entry(tenant, f"{base}:{name}", record, check=False)

    def delete(self, tenant: str, base: str, name: str) -> None:
        with self._lock:
            data = self._read() if self._file.exists() else {"next_version": 1, "tenants": {}}
            if data["tenants"].get(tenant, {}).pop(f"{base}:{name}", None) is None:
                raise CatalogError(404, f"adapter {base}:{name} does not exist")
            self._write(data)
        logger.info("tenant %s deleted adapter %s:%s", tenant, base, name)

    def _write(self, data: dict) -> None:
        """Replaces the catalog file atomically: a failed write (a full disk) leaves the
        old catalog in place, removes its partial copy and becomes a CatalogError."""
        temporary = None
        try:
            handle, temporary = tempfile.mkstemp(dir=self.root, prefix=".catalog-", suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                json.dump(data, out, indent=1, sort_keys=True)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self._file)
        except OSError as exc:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
            logger.error("writing the adapter catalog in %s failed: %r", self.root, exc)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CatalogError(
                    507, "the adapter storage is full; the catalog is unchanged, retry later"
                ) from None
            raise CatalogError(
                503, f"the adapter catalog could not be written ({exc.strerror}); retry later"
            ) from None
