"""NVRTC through cuda-python (cuda.bindings.nvrtc): options, compile, the content-addressed cubin cache, located errors.

The cache key covers everything that can change a binary: the rendered source, the options,
the arch, the NVRTC version and moegen's version (the source has no #include, so there are no
headers to hash). Entries are written to a temporary directory and renamed into place; a file
lock with a re-check after acquiring it keeps concurrent builds from compiling twice; an entry
whose cubin does not match its recorded hash is rebuilt, never loaded. Only a process holding
the lock removes or replaces an entry, so a reader never deletes what a writer just put there.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from . import __version__
from .cache import cache_dir, read_entry

STD = "c++17"


class CompileError(RuntimeError):
    """NVRTC rejected generated code; the message locates it in the generated file."""


class CacheError(RuntimeError):
    """The cubin cache directory cannot be used (MOEGEN_CACHE, or --no-cache to bypass it)."""


@dataclass(frozen=True)
class KernelResources:
    registers: int
    smem_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class Compiled:
    cubins: tuple[bytes, ...]  # one per program: a layer is compiled as `parts` programs (compile_parts)
    log: str
    resources: dict[str, KernelResources]
    cached: bool
    key: str
    keys: tuple[str, ...] = ()  # the cache entries' keys, one per program

    @property
    def cubin(self) -> bytes:
        """The cubin of a source compiled as one program."""
        if len(self.cubins) != 1:
            raise ValueError(f"{len(self.cubins)} cubins (a layer compiled in parts): use .cubins")
        return self.cubins[0]


@functools.cache
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"NVRTC is not usable: {err}")
    return f"{major}.{minor}"


SPLIT = 2  # NVRTC compiles the kernels of one program in 2 threads (--split-compile); a layer in
# parts (moegen.plan.COMPILE_PARTS) compiles each part in one thread


def options_of(arch: str, part: int | None = None) -> dict[str, object]:
    """NVRTC's options: one program (split over SPLIT threads), or part `part` of a layer (one thread)."""
    opts: dict[str, object] = {"arch": arch, "std": STD, "ptxas_options": ["-v"], "split_compile": SPLIT}
    if part is not None:
        opts.update(split_compile=1, define_macro=f"MOE_PART={part}")
    return opts


def cache_key(source: str, arch: str, part: int | None = None) -> str:
    h = hashlib.sha256()
    for piece in (source, json.dumps(options_of(arch, part), sort_keys=True), arch, nvrtc_version(), __version__):
        h.update(piece.encode())
        h.update(b"\0")
    return h.hexdigest()


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$")


def parse_resources(log: str) -> dict[str, KernelResources]:
    """Per-kernel registers, shared memory, stack and spills from ptxas's -v report."""
    out: dict[str, KernelResources] = {}
    name, stack = None, (0, 0, 0)
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            name, stack = m.group(1), (0, 0, 0)
        elif (m := _STACK.search(line)) and name:
            stack = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line.strip())) and name:
            out[name] = KernelResources(
                registers=int(m.group(1)), smem_bytes=int(m.group(2) or 0),
                stack_bytes=stack[0], spill_stores=stack[1], spill_loads=stack[2],
            )
            name = None
    return out


_ERROR_AT = re.compile(r"\((\d+)\): (?:catastrophic )?error: *(.*)")


def _locate(log: str, source: str, display: str) -> str:
    """`display:line: error: why`, then a numbered excerpt of the generated file around the first error."""
    m = _ERROR_AT.search(log)
    if not m:
        return f"{display}: error: NVRTC gave no line (see the log)\n"
    n, why = int(m.group(1)), m.group(2).strip()
    lines = source.splitlines()
    lo, hi = max(1, n - 3), min(len(lines), n + 3)
    excerpt = "\n".join(f"{'>' if i == n else ' '} {i:5d} | {lines[i - 1]}" for i in range(lo, hi + 1))
    return f"{display}:{n}: error: {why}\n{excerpt}\n"


def _clean(log: str) -> str:
    return log.replace("\x00", "").strip()  # NVRTC pads its logs with NULs


def _flags(arch: str, part: int | None = None) -> list[bytes]:
    """options_of as NVRTC's command-line flags."""
    o = options_of(arch, part)
    flags = [f"-arch={o['arch']}", *(f"--ptxas-options={v}" for v in o["ptxas_options"])]  # type: ignore[attr-defined]
    if "define_macro" in o:
        flags.append(f"--define-macro={o['define_macro']}")
    flags += [f"--std={o['std']}", f"--split-compile={o['split_compile']}"]
    return [f.encode() for f in flags]


def _compile_uncached(source: str, arch: str, display: str, part: int | None = None) -> tuple[bytes, str]:
    # NVRTC through cuda-python's own binding of it (cuda.bindings.nvrtc, which cuda.core's Program
    # calls too): importing cuda.core costs 0.2-0.3 s of a cold build on a 2-core machine, the
    # binding 0.05 s. The flags are the ones cuda.core's ProgramOptions makes of options_of (the
    # same cubins); the binding releases the GIL while NVRTC compiles, so parts compile at once.
    from cuda.bindings import nvrtc

    def check(result: tuple, what: str) -> tuple:
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(f"{display}: NVRTC {nvrtc_version()} failed to {what}: {result[0].name}")
        return result[1:]

    (prog,) = check(nvrtc.nvrtcCreateProgram(source.encode(), os.path.basename(display).encode(), 0, [], []),
                    "create the program")
    try:
        flags = _flags(arch, part)
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(flags), flags)
        (size,) = check(nvrtc.nvrtcGetProgramLogSize(prog), "report the log size")
        buf = b" " * size
        check(nvrtc.nvrtcGetProgramLog(prog, buf), "report the log")
        log = _clean(buf.decode(errors="replace"))
        if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            # First line stands alone (file:line: error: why); the excerpt and NVRTC's full log follow.
            raise CompileError(
                f"{_locate(log, source, display)}(NVRTC {nvrtc_version()}, {arch}, compiling {display})\n"
                f"full log:\n{status.name}\n{log}"
            )
        (size,) = check(nvrtc.nvrtcGetCUBINSize(prog), "report the cubin size")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "return the cubin")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return cubin, log


def compile_cuda(source: str, arch: str, display: str = "layer.cu", use_cache: bool = True,
                 part: int | None = None) -> Compiled:
    """Compile (or fetch from the cache) the cubin of `source` for `arch`: the whole source, or the
    kernels of part `part` (MOE_PART defined)."""
    key = cache_key(source, arch, part)
    if not use_cache:
        cubin, log = _compile_uncached(source, arch, display, part)
        return Compiled((cubin,), log, parse_resources(log), cached=False, key=key, keys=(key,))
    root = cache_dir()
    entry = root / key
    hit = _cached(key)
    if hit:
        return hit
    try:
        (root / "locks").mkdir(parents=True, exist_ok=True)
        # 256 lock stripes by key prefix: bounded lock files; two keys sharing one only wait.
        lock = FileLock(str(root / "locks" / f"{key[:2]}.lock"))
        lock.acquire()
    except OSError as exc:
        raise CacheError(f"{root}: cannot use the cubin cache: {exc.strerror or exc} "
                         "(set MOEGEN_CACHE to a writable directory, or build with --no-cache)") from None
    try:
        hit = _cached(key)  # another process may have built it while we waited
        if hit:
            return hit
        cubin, log = _compile_uncached(source, arch, display, part)
        _write_entry(root, entry, key, cubin, log)
    finally:
        lock.release()
    return Compiled((cubin,), log, parse_resources(log), cached=False, key=key, keys=(key,))


def compile_parts(source: str, arch: str, parts: int, display: str = "layer.cu", use_cache: bool = True) -> Compiled:
    """A layer's source as `parts` programs compiled at once, one thread each (each its own cache
    entry), or as one program where parts is 1: the cubins in part order, the logs and resources
    together. The first error (in part order) is raised, after every part has finished."""
    if parts == 1:
        return compile_cuda(source, arch, display, use_cache)
    done = [_cached(cache_key(source, arch, p)) for p in range(parts)] if use_cache else [None]
    if not all(done):
        # NVRTC's binding loads lazily: here, once, not in two threads at a time (a half-imported
        # module is what a racing thread would see)
        nvrtc_version()
        with ThreadPoolExecutor(parts) as pool:
            futures = [pool.submit(compile_cuda, source, arch, display, use_cache, p) for p in range(parts)]
            done = [f.result() for f in futures]
    resources: dict[str, KernelResources] = {}
    for c in done:
        resources.update(c.resources)
    key = hashlib.sha256("".join(c.key for c in done).encode()).hexdigest()
    return Compiled(tuple(c.cubin for c in done), "\n".join(c.log for c in done), resources,
                    cached=all(c.cached for c in done), key=key, keys=tuple(c.key for c in done))


def _cached(key: str) -> Compiled | None:
    """The cache's entry `key`, if it holds a whole one (no lock: only read)."""
    hit = read_entry(cache_dir() / key, key)
    return Compiled((hit[0],), hit[1], parse_resources(hit[1]), cached=True, key=key, keys=(key,)) if hit else None


def _write_entry(root: Path, entry: Path, key: str, cubin: bytes, log: str) -> None:
    """Under the lock: write a temporary directory, then rename it over whatever `entry` held."""
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    except OSError as exc:
        raise CacheError(f"{root}: cannot write to the cubin cache: {exc.strerror or exc}") from None
    try:
        (tmp / "layer.cubin").write_bytes(cubin)
        meta = {"key": key, "cubin_sha256": hashlib.sha256(cubin).hexdigest(), "log": log, "moegen": __version__}
        (tmp / "meta.json").write_text(json.dumps(meta))
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)  # corrupt: only the lock holder removes an entry
        elif entry.exists() or entry.is_symlink():
            entry.unlink()
        os.replace(tmp, entry)
    except OSError as exc:
        raise CacheError(f"{entry}: cannot write the cache entry: {exc.strerror or exc}") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
