"""Up-to-date builds: `moegen build` of a spec whose inputs have not changed since its last build
finishes without importing the compiler (pydantic, Jinja, NVRTC's bindings): standard library only.

After each build that uses the cubin cache, a stamp is written to <cache>/builds/<where>.json,
<where> the hash of the spec file's absolute path, the output root, --arch, the interpreter and its
import path. The stamp holds the digest of every input the build read and the digests of what it
wrote:

- inputs: the spec file's bytes; the tuning file beside the output (<out>/<name>.tuning.json) or
  its absence; moegen's own code (the package's .py files and the templates); the libraries the
  spec and the rendering go through (PyYAML, pydantic, Jinja: the path, size and time of each
  one's module file); and the NVRTC library that compiled the cubins (path, size and time), written
  only where cuda-python found it in site-packages, the first place it looks;
- outputs: the hash of each generated file, and the cache keys of the cubins (each entry's cubin is
  checked against its recorded hash, as a cached compile does).

The build is up to date when every input is as recorded and every output is still there, as it was
written. Anything else (a changed or missing file, an unreadable stamp) runs the whole build, which
writes the stamp again. --no-cache never reads or writes stamps.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from . import __version__
from .cache import cache_dir, read_entry

LIBRARIES = ("yaml", "pydantic", "pydantic_core", "jinja2", "markupsafe")  # what the spec and the render go through
STAMP_VERSION = 1


def template_dir() -> Path:
    """templates/ beside the package in a source tree; moegen/templates once installed."""
    here = Path(__file__).resolve().parent
    for cand in (here / "templates", here.parent / "templates"):
        if (cand / "layer.cu.j2").is_file():
            return cand
    raise FileNotFoundError(f"moegen templates not found beside {here}")


def _file_id(path: str | Path) -> list:
    st = os.stat(path)
    return [str(path), st.st_size, st.st_mtime_ns]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _stamp_path(spec_path: str | Path, out_root: str | Path, arch: str | None) -> Path:
    where = json.dumps([str(Path(spec_path).absolute()), str(Path(out_root).absolute()), arch, sys.executable,
                        sys.path])
    return cache_dir() / "builds" / f"{_sha(where.encode())}.json"


def _inputs(spec_path: str | Path, out_root: str | Path, name: str, nvrtc: list | None) -> str:
    """The digest of everything a build of this spec into out_root reads (nvrtc: the library's id)."""
    h = hashlib.sha256()

    def add(piece: bytes) -> None:
        h.update(len(piece).to_bytes(8, "little"))
        h.update(piece)

    add(f"stamp {STAMP_VERSION} moegen {__version__}".encode())
    add(Path(spec_path).read_bytes())
    tuning = Path(out_root) / f"{name}.tuning.json"
    add(tuning.read_bytes() if tuning.is_file() else b"(no tuning file)")
    here = Path(__file__).resolve().parent
    for root, pattern in ((here, "*.py"), (template_dir(), "*.j2")):
        for p in sorted(root.glob(pattern)):
            add(p.name.encode())
            add(p.read_bytes())
    for mod in LIBRARIES:
        found = importlib.util.find_spec(mod)
        add(json.dumps(_file_id(found.origin) if found and found.origin else None).encode())
    add(json.dumps(nvrtc).encode())
    return h.hexdigest()


def check(spec_path: str | Path, out_root: str | Path, arch: str | None) -> str | None:
    """The build's summary line ("up to date in 0.004 s") where the last build of this spec into
    out_root is up to date, else None (then the whole build runs)."""
    t0 = time.perf_counter()
    try:
        stamp = json.loads(_stamp_path(spec_path, out_root, arch).read_text())
        if not isinstance(stamp, dict) or stamp.get("version") != STAMP_VERSION:
            return None
        name, nvrtc = stamp["name"], stamp["nvrtc"]
        if _file_id(nvrtc[0]) != nvrtc:
            return None
        if _inputs(spec_path, out_root, name, nvrtc) != stamp["inputs"]:
            return None
        out_dir = Path(out_root) / name
        files = stamp["files"]
        if sorted(p.name for p in out_dir.iterdir()) != sorted(files):
            return None
        for fname, digest in files.items():
            if _sha((out_dir / fname).read_bytes()) != digest:
                return None
        if not all(read_entry(cache_dir() / key, key) for key in stamp["cubins"]):
            return None
        how = f"up to date in {time.perf_counter() - t0:.3f} s"
        return stamp["summary"].replace("{how}", how).replace("{out_dir}", str(out_dir))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def inputs_now(spec_path: str | Path, out_root: str | Path, name: str) -> tuple[list, str] | None:
    """(the NVRTC library's id, the inputs' digest) as a build starts (just after reading the spec),
    or None where no stamp is kept: NVRTC not found in site-packages, or an input unreadable."""
    from cuda import pathfinder

    lib = pathfinder.load_nvidia_dynamic_lib("nvrtc")  # (loaded once, cached: the one NVRTC's bindings use)
    try:
        if lib.found_via != "site-packages":
            return None
        nvrtc = _file_id(lib.abs_path)
        return nvrtc, _inputs(spec_path, out_root, name, nvrtc)
    except OSError:
        return None


def record(spec_path: str | Path, out_root: str | Path, arch: str | None, name: str, inputs: tuple[list, str] | None,
           files: dict[str, str], cubin_keys: tuple[str, ...], summary: str) -> None:
    """After a build wrote `files` into out_root/name from `inputs` (inputs_now's, taken as it
    started): its stamp, or (inputs None) none, removing an older one. summary: the build's line,
    {how} and {out_dir} left to fill. A stamp that cannot be written is left out (the next build
    then runs whole)."""
    path = _stamp_path(spec_path, out_root, arch)
    try:
        if inputs is None:
            path.unlink(missing_ok=True)
            return
        stamp = {"version": STAMP_VERSION, "name": name, "nvrtc": inputs[0], "inputs": inputs[1],
                 "files": {f: _sha(text.encode("utf-8")) for f, text in files.items()},
                 "cubins": list(cubin_keys), "summary": summary}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".stamp-", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(stamp, f)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return
