"""Where the cubin cache lives and how an entry is read: standard library only, so that the
up-to-date check of a build (moegen.uptodate) can read entries without importing the compiler.
Entries are written (under a lock) by moegen.nvrtc."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def cache_dir() -> Path:
    """$MOEGEN_CACHE, else $XDG_CACHE_HOME/moegen, else ~/.cache/moegen (an empty variable counts as unset)."""
    if os.environ.get("MOEGEN_CACHE"):
        return Path(os.environ["MOEGEN_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moegen"


def read_entry(entry: Path, key: str) -> tuple[bytes, str] | None:
    """The entry's cubin and log, or None when it is missing, partial or corrupt (never loaded then)."""
    try:
        meta = json.loads((entry / "meta.json").read_text())
        cubin = (entry / "layer.cubin").read_bytes()
    except (OSError, ValueError):
        return None
    if (not isinstance(meta, dict) or meta.get("key") != key or not isinstance(meta.get("log"), str)
            or hashlib.sha256(cubin).hexdigest() != meta.get("cubin_sha256")):
        return None
    return cubin, meta["log"]
