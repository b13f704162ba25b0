"""Disk and host tiers of the adapter store.

    disk registry      name -> adapter folder (registered at runtime, or every subfolder
                       of `adapter_root` at start)
    host LRU cache     up to `max_cpu_loras` validated adapters (`LoRAAdapter`) in memory
    device slots       adapters/slots.py, filled by the model runner each step

Loads run on a small thread pool (`load_async`), never on the engine's step loop. A
cached adapter is reused only while its files are unchanged (size and mtime of both
files), so an adapter rewritten in place under the same name is loaded again and gets
a new identity key (its weights hash), and with it a fresh prefix-cache namespace.
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

from loraplex.adapters.peft_format import AdapterError, LoRAAdapter, load_peft_adapter
from loraplex.platform.models.arch import ModelArch

logger = logging.getLogger(__name__)

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FILES = ("adapter_config.json", "adapter_model.safetensors")

Loader = Callable[[Path, ModelArch, int, str], LoRAAdapter]
"""(folder, base arch, max rank, name) -> validated adapter; `load_peft_adapter` by default."""


@dataclass
class StoreStats:
    loads: int = 0
    hits: int = 0
    evictions: int = 0
    failures: int = 0
    load_seconds: list[float] = field(default_factory=list)


def _signature(folder: Path) -> tuple[tuple[int, int], ...]:
    """(size, mtime_ns) of the adapter's files; missing files read as (-1, -1)."""
    stats = []
    for name in _FILES:
        try:
            stat = (folder / name).stat()
            stats.append((stat.st_size, stat.st_mtime_ns))
        except OSError:
            stats.append((-1, -1))
    return tuple(stats)


class AdapterStore:
    def __init__(
        self,
        arch: ModelArch,
        max_rank: int,
        max_cpu_loras: int,
        root: str | Path | None = None,
        loader: Loader = load_peft_adapter,
        max_workers: int = 2,
    ) -> None:
        self.arch = arch
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.loader = loader
        self.stats = StoreStats()
        self._registry: dict[str, Path] = {}
        self._cache: OrderedDict[Path, tuple[tuple, LoRAAdapter]] = OrderedDict()
        self._inflight: dict[Path, Future[LoRAAdapter]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="loraplex-adapter-load")
        if root is not None:
            self._register_root(Path(root))

    # ---- disk registry ---------------------------------------------------------------
    def _register_root(self, root: Path) -> None:
        if not root.is_dir():
            raise AdapterError(f"adapter_root {root} is not a directory")
        for folder in sorted(root.iterdir()):
            if (folder / "adapter_config.json").is_file() and ADAPTER_NAME.match(folder.name):
                self.register(folder.name, folder)
        logger.info("registered %d adapter(s) from %s", len(self._registry), root)

    def register(self, name: str, folder: str | Path) -> None:
        """Names an adapter folder (replacing an earlier registration of the name)."""
        if not ADAPTER_NAME.match(name):
            raise AdapterError(
                f"adapter name {name!r} must be 1-128 letters, digits, '.', '_' or '-'"
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
            self._cache.pop(folder, None)
        logger.info("adapter %s unregistered", name)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._registry)

    def resolve(self, spec: str | Path, name: str | None = None) -> tuple[str, Path]:
        """A registered name, or else an adapter folder path -> (name, resolved folder).
        `name` labels a folder in logs and metrics (default: the folder's name)."""
        with self._lock:
            folder = self._registry.get(str(spec))
        if folder is not None:
            return str(spec), folder
        path = Path(spec).expanduser()
        if path.is_dir():
            path = path.resolve()
            return name or path.name, path
        raise AdapterError(
            f"unknown adapter {str(spec)!r}: not a registered name and not a directory"
        )

    # ---- host cache ------------------------------------------------------------------
    def load(self, spec: str | Path, name: str | None = None) -> LoRAAdapter:
        """The validated adapter for a name or folder, from the cache or from disk."""
        return self.load_async(spec, name).result()

    def load_async(self, spec: str | Path, name: str | None = None) -> Future[LoRAAdapter]:
        """Like `load`, on the store's thread pool; one disk read per folder at a time."""
        name, folder = self.resolve(spec, name)
        signature = _signature(folder)
        with self._lock:
            cached = self._cache.get(folder)
            if cached is not None and cached[0] == signature and cached[1].name == name:
                self._cache.move_to_end(folder)
                self.stats.hits += 1
                done: Future[LoRAAdapter] = Future()
                done.set_result(cached[1])
                return done
            future = self._inflight.get(folder)
            if future is None:
                future = self._pool.submit(self._read, name, folder, signature)
                self._inflight[folder] = future
            return future

    def _read(self, name: str, folder: Path, signature: tuple) -> LoRAAdapter:
        started = time.perf_counter()
        try:
            adapter = self.loader(folder, self.arch, self.max_rank, name)
        except Exception:
            with self._lock:
                self.stats.failures += 1
                self._inflight.pop(folder, None)
            raise
        elapsed = time.perf_counter() - started
        with self._lock:
            self._inflight.pop(folder, None)
            self._cache[folder] = (signature, adapter)
            self._cache.move_to_end(folder)
            while len(self._cache) > self.max_cpu_loras:
                evicted, (_, old) = self._cache.popitem(last=False)
                self.stats.evictions += 1
                logger.info("adapter %s evicted from host memory (%s)", old.name, evicted)
            self.stats.loads += 1
            self.stats.load_seconds.append(elapsed)
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

    def evict(self, folder: str | Path) -> bool:
        """Drops a folder's host copy (requests already holding it keep theirs)."""
        with self._lock:
            evicted = self._cache.pop(Path(folder).resolve(), None) is not None
        if evicted:
            self.stats.evictions += 1
            logger.info("adapter at %s evicted from host memory", folder)
        return evicted

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
