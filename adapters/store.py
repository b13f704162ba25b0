"""Disk and host tiers of the adapter store.

    disk registry      name -> adapter folder (registered at runtime, or every subfolder
                       of `adapter_root` at start)
    host LRU cache     up to `max_cpu_loras` validated adapters (`LoRAAdapter`) in memory,
                       and up to `max_cpu_bytes` of them where set: the one host LRU of a
                       replica (the serving layer keeps none)
    device slots       adapters/slots.py, filled by the model runner each step

A copy loaded for the serving catalog carries the catalog's model id (`owner/name@version`,
deployments/catalog.py): `held(model_id)` finds it again without the catalog, `held_ids`
lists what the host tier holds for the router, and every listener added by
`on_evict` hears the model ids of each copy that leaves host memory. A copy's weights
are named by their content hash (`LoRAAdapter.key`) in the device slots and the prefix
cache.

Loads run on a small thread pool (`load_async`), never on the engine's step loop.
Copies are cached per (folder, version):
- with a `version` (the Serve catalog's, which grows on every register and unload), a
  copy is pinned: the folder is read once per version, and a new version always reads
  the files again, so an adapter rewritten in place and then unloaded is served with
  its new weights even if size and mtime were kept; its identity key is the hash of
  what was read, so it also gets a fresh prefix-cache namespace;
- without one (offline use), a copy is reused while the files' size and mtime are
  unchanged, and read again otherwise.

A load with a `root` (a tenant's adapter root) opens the folder and its files under
that root without following any symbolic link, at the moment of reading
(peft_format.load_peft_adapter), so a link swapped in after registration is refused.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from loraplex.adapters.peft_format import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    AdapterError,
    BaseModelShape,
    LoRAAdapter,
    load_peft_adapter,
)

logger = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""An adapter name, everywhere (this store, the serve config, the tenant catalog): 1-64
letters, digits, '.', '_' or '-', the first a letter or digit."""
ADAPTER_FILES = (CONFIG_NAME, WEIGHTS_NAME)
"""The files of a PEFT LoRA adapter folder that loraplex reads."""

Loader = Callable[..., LoRAAdapter]
"""(folder, base arch, max rank, name[, root=...][, max_vocab_size=...]) -> validated
adapter; `load_peft_adapter` by default. `root` is passed only for contained loads,
`max_vocab_size` only where the engine allows resized vocabularies."""
CacheKey = tuple[Path, int | None]
"""(folder, catalog version or None)"""
EvictionListener = Callable[[str], None]
"""Told the model id of a copy that left host memory (called outside the store's lock)."""


@dataclass
class StoreStats:
    loads: int = 0
    hits: int = 0
    evictions: int = 0
    failures: int = 0
    load_seconds: dict[CacheKey, float] = field(default_factory=dict)
    """How long the read of each copy now in host memory took; an evicted copy's goes
    with it (every catalog version is a new copy)."""


def _signature(folder: Path) -> tuple[tuple[int, int], ...]:
    """(size, mtime_ns) of the adapter's files; missing files read as (-1, -1)."""
    stats = []
    for name in ADAPTER_FILES:
        try:
            stat = (folder / name).stat()
            stats.append((stat.st_size, stat.st_mtime_ns))
        except OSError:
            stats.append((-1, -1))
    return tuple(stats)


class AdapterStore:
    def __init__(
        self,
        arch: BaseModelShape,
        max_rank: int,
        max_cpu_loras: int,
        root: str | Path | None = None,
        loader: Loader = load_peft_adapter,
        max_workers: int = 2,
        max_vocab_size: int | None = None,
        max_cpu_bytes: int | None = None,
    ) -> None:
        """`max_cpu_loras` copies, and at most `max_cpu_bytes` of them (`num_bytes`:
        LoRA pairs and saved modules) where set, stay in host memory; the newest copy
        stays even when it alone is over the bytes."""
        self.arch = arch
        self.max_rank = max_rank
        self.max_vocab_size = max_vocab_size
        self.max_cpu_bytes = max_cpu_bytes
        self.max_cpu_loras = max_cpu_loras
        self.loader = loader
        self.stats = StoreStats()
        self._registry: dict[str, Path] = {}
        self._cache: OrderedDict[CacheKey, tuple[tuple, LoRAAdapter]] = OrderedDict()
        self._ids_of: dict[CacheKey, set[str]] = {}
        """The catalog model ids each held copy was loaded under."""
        self._key_of: dict[str, CacheKey] = {}
        self._listeners: list[EvictionListener] = []
        self._inflight: dict[CacheKey, Future[LoRAAdapter]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loraplex-adapter-load")
        if root is not None:
            self._register_root(Path(root))

    # ---- disk registry ---------------------------------------------------------------
    def _register_root(self, root: Path) -> None:
        if not root.is_dir():
            raise AdapterError(f"adapter_root {root} is not a directory")
        for folder in sorted(root.iterdir()):
            if (folder / CONFIG_NAME).is_file() and ADAPTER_NAME.match(folder.name):
                self.register(folder.name, folder)
        logger.info("registered %d adapter(s) from %s", len(self._registry), root)

    def register(self, name: str, folder: str | Path) -> None:
        """Names an adapter folder (replacing an earlier registration of the name)."""
        if not ADAPTER_NAME.match(name):
            raise AdapterError(
                f"adapter name {name!r} must be 1-64 letters, digits, '.', '_' or '-'"
            )
        folder = Path(folder).resolve()
        if not folder.is_dir():
            raise AdapterError(f"adapter directory {folder} does not exist")
        with self._lock:
            self._registry[name] = folder
        logger.info("adapter %s registered: %s", name, folder)

    def unregister(self, name: str) -> None:
        """Forgets a name and drops its host copy (running requests keep theirs)."""
        with self._lock:
            folder = self._registry.pop(name, None)
            if folder is None:
                raise AdapterError(f"adapter {name!r} is not registered")
            dropped = [self._drop(key)[1] for key in [k for k in self._cache if k[0] == folder]]
        self._tell_evicted(dropped)
        logger.info("adapter %s unregistered", name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registry)

    def resolve(
        self, spec: str | Path, name: str | None = None, root: Path | None = None
    ) -> tuple[str, Path]:
        """A registered name, or else an adapter folder path -> (name, folder).
        `name` labels a folder in logs and metrics (default: the folder's name). A
        folder under a `root` stays as given (the loader checks it without following
        links); other folders are resolved."""
        with self._lock:
            folder = self._registry.get(str(spec))
        if folder is not None:
            return str(spec), folder
        path = Path(spec).expanduser()
        if root is not None:
            return name or path.name, path
        if path.is_dir():
            path = path.resolve()
            return name or path.name, path
        raise AdapterError(
            f"unknown adapter {str(spec)!r}: not a registered name and not a directory"
        )

    # ---- host cache ------------------------------------------------------------------
    def load(
        self,
        spec: str | Path,
        name: str | None = None,
        root: Path | None = None,
        version: int | None = None,
    ) -> LoRAAdapter:
        """The validated adapter for a name or folder, from the cache or from disk."""
        return self.load_async(spec, name, root, version).result()

    def load_async(
        self,
        spec: str | Path,
        name: str | None = None,
        root: Path | None = None,
        version: int | None = None,
        model_id: str | None = None,
    ) -> Future[LoRAAdapter]:
        """Like `load`, on the store's thread pool; one disk read per folder and version
        at a time. `root`: the folder must lie under it, reached without links;
        `version`: pins the copy to that version (see the module docstring);
        `model_id`: the catalog's id for it, which `held` then answers."""
        name, folder = self.resolve(spec, name, root)
        key = (folder, version)
        signature = _signature(folder) if version is None else ()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None and cached[0] == signature and cached[1].name == name:
                self._cache.move_to_end(key)
                self.stats.hits += 1
                self._label(key, model_id)
                done: Future[LoRAAdapter] = Future()
                done.set_result(cached[1])
                return done
            future = self._inflight.get(key)
            if future is None:
                future = self._pool.submit(self._read, name, key, root, signature)
                self._inflight[key] = future
        if model_id is not None:
            future.add_done_callback(lambda done: self._label_loaded(key, model_id, done))
        return future

    def held(self, model_id: str) -> LoRAAdapter | None:
        """The host copy loaded under `model_id` (most recently used from now on), or
        None: never loaded, evicted, or (unpinned) its files changed since."""
        with self._lock:
            key = self._key_of.get(model_id)
            cached = self._cache.get(key) if key is not None else None
            if cached is None:
                return None
            if key[1] is None and cached[0] != _signature(key[0]):
                return None
            self._cache.move_to_end(key)
            self.stats.hits += 1
            return cached[1]

    def held_ids(self) -> dict[str, bytes]:
        """Model id -> identity key of every copy in host memory loaded under one."""
        with self._lock:
            return {m: self._cache[key][1].key for m, key in self._key_of.items()}

    def on_evict(self, listener: EvictionListener) -> None:
        """Adds a listener told the model ids of every copy that leaves host memory."""
        with self._lock:
            self._listeners.append(listener)

    def _label(self, key: CacheKey, model_id: str | None) -> None:
        """Records that the held copy `key` is `model_id` too (the lock held)."""
        if model_id is not None and key in self._cache:
            self._ids_of.setdefault(key, set()).add(model_id)
            self._key_of[model_id] = key

    def _label_loaded(self, key: CacheKey, model_id: str, done: Future[LoRAAdapter]) -> None:
        """A load under `model_id` finished: label its copy, unless it already left."""
        if done.cancelled() or done.exception() is not None:
            return
        with self._lock:
            held = key in self._cache
            self._label(key, model_id)
        if not held:
            self._tell_evicted([{model_id}])

    def _read(self, name: str, key: CacheKey, root: Path | None, signature: tuple) -> LoRAAdapter:
        folder = key[0]
        started = time.perf_counter()
        try:
            options = {} if root is None else {"root": root}
            if self.max_vocab_size is not None:
                options["max_vocab_size"] = self.max_vocab_size
            adapter = self.loader(folder, self.arch, self.max_rank, name, **options)
        except Exception:
            with self._lock:
                self.stats.failures += 1
                self._inflight.pop(key, None)
            raise
        elapsed = time.perf_counter() - started
        dropped = []
        with self._lock:
            self._inflight.pop(key, None)
            self._cache[key] = (signature, adapter)  # replaces a changed unpinned copy
            self._cache.move_to_end(key)
            self.stats.load_seconds[key] = elapsed
            while len(self._cache) > self.max_cpu_loras or self._over_bytes():
                evicted = next(iter(self._cache))
                old, ids = self._drop(evicted)
                dropped.append(ids)
                self.stats.evictions += 1
                logger.info("adapter %s evicted from host memory (%s)", old.name, evicted[0])
            self.stats.loads += 1
        self._tell_evicted(dropped)
        logger.info(
            "adapter %s loaded from %s in %.1f ms (rank %d, %d modules, key %s)",
            name,
            folder,
            elapsed * 1e3,
            adapter.rank,
            len(adapter.modules),
            adapter.key_hex[:12],
        )
        return adapter

    def evict(self, folder: str | Path, version: int | None = None) -> bool:
        """Drops the host copy of a folder (at `version`, or the unversioned one);
        requests already holding it keep theirs."""
        key = (Path(folder) if version is not None else Path(folder).resolve(), version)
        with self._lock:
            dropped = [self._drop(key)[1]] if key in self._cache else []
        if dropped:
            self.stats.evictions += 1
            logger.info("adapter at %s evicted from host memory", folder)
            self._tell_evicted(dropped)
        return bool(dropped)

    def _drop(self, key: CacheKey) -> tuple[LoRAAdapter, set[str]]:
        """Removes a host copy, its load time and its model ids (the lock held); returns
        the copy and the ids to tell the listeners about."""
        self.stats.load_seconds.pop(key, None)
        ids = self._ids_of.pop(key, set())
        for model_id in ids:
            self._key_of.pop(model_id, None)
        return self._cache.pop(key)[1], ids

    def _tell_evicted(self, dropped: list[set[str]]) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for model_id in sorted(set().union(*dropped)):
            for listener in listeners:
                listener(model_id)

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    @property
    def held_bytes(self) -> int:
        """Host memory of the copies held (their tensors)."""
        with self._lock:
            return self._held_bytes()

    def _held_bytes(self) -> int:
        return sum(adapter.num_bytes for _, adapter in self._cache.values())

    def _over_bytes(self) -> bool:
        if self.max_cpu_bytes is None or len(self._cache) <= 1:
            return False
        return self._held_bytes() > self.max_cpu_bytes

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
