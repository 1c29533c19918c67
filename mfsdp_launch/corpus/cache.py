"""Where token caches live: `data.cache_dir`, else $MFSDP_CACHE_DIR, else ~/.cache/mfsdp_launch/tokens."""

from __future__ import annotations

import os
from typing import Optional

CACHE_DIR_ENV = "MFSDP_CACHE_DIR"
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "mfsdp_launch", "tokens")


def cache_dir(configured: Optional[str] = None) -> str:
    d = configured or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(str(d)))
