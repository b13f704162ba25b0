"""loraplex's cache folder: `$LORAPLEX_CACHE_DIR`, else ~/.cache/loraplex.

The lowest layer owns the rule because the native kernels build into it
(`torch_extensions/`); the platform keeps converted models (`models/`) and GEMM probe
results (`gemm_probe/`) there too.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "LORAPLEX_CACHE_DIR"


def cache_base() -> Path:
    """loraplex's cache directory: `$LORAPLEX_CACHE_DIR` or ~/.cache/loraplex."""
    base = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "loraplex"
    return Path(base).expanduser()
