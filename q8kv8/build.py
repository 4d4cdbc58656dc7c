"""Building CuTe DSL kernels for sm_90a and keeping them in the disk cache (``q8kv8.disk_cache``).

``build_or_load(name, ...)`` returns a kernel's TVM-FFI function: loaded from the cache entry of the current
sources, or compiled (``compile_fn``, with fake tensors: no GPU needed), exported as an object file and
cached. An entry is keyed by a hash of the kernel sources (``cute_kernels/``, this module and
``q8kv8/kernels.py``, which holds the compile arguments), the CuTe DSL version and the arch; it holds the
object file, its SHA-256 (a damaged object is rebuilt), the PTX and, once a listing has asked for it, what
``ptxas -v`` says about that PTX (``ptxas_report``: ptxas runs once per PTX and ptxas version). A process's
compiles are serialised by a thread lock (the DSL's compile is not thread-safe); a file lock per variant
makes a process wait only for another's build of the same variant, so processes build different variants
at once (``python -m q8kv8.compile --jobs N``); files are written under temporary names renamed into
place. The first build of a process says so on stderr
(``disk_cache.announce_build``), and each variant built says so in one line with its seconds
(``disk_cache.announce_built``); loads are silent.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from q8kv8 import disk_cache

TARGET_ARCH = "sm_90a"
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_KEYED_SOURCES = ("q8kv8/build.py", "q8kv8/kernels.py")
_compile_lock = threading.Lock()
_dsl_import_lock = threading.Lock()


class KernelCompileError(RuntimeError):
    """A kernel variant failed to compile or load; the one-line message names the variant, and
    ``log_path`` the file with the full report (the DSL's own error, often pages of MLIR)."""

    log_path: Path | None = None


@dataclass
class Variant:
    """One compiled kernel variant and where it came from."""

    name: str
    d_qk: int
    precision: str
    function: object = field(repr=False)
    source: str  # "compiled" or "cache"
    seconds: float  # compile or load time
    object_path: Path
    ptx_path: Path | None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    rebuilt_corrupt: int = 0


def _sm90_visible() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def import_dsl():
    """Import the CuTe DSL, targeting sm_90a when no SM90 GPU is visible (set before import). One thread at a
    time: threads that import the DSL's packages at once can see one of its modules partly initialised."""
    with _dsl_import_lock:
        if "CUTE_DSL_ARCH" not in os.environ and not _sm90_visible():
            os.environ["CUTE_DSL_ARCH"] = TARGET_ARCH
        import cutlass
        import cutlass.cute as cute

    return cutlass, cute


def _cache_key(dsl_version: str) -> str:
    digest = hashlib.sha256()
    sources = sorted((_PACKAGE_ROOT / "cute_kernels").rglob("*.py")) + [
        _PACKAGE_ROOT / s for s in _KEYED_SOURCES
    ]
    for source in sources:
        digest.update(source.relative_to(_PACKAGE_ROOT).as_posix().encode())
        digest.update(source.read_bytes())
    digest.update(f"dsl={dsl_version};arch={TARGET_ARCH}".encode())
    return digest.hexdigest()[:24]


def compile_for_tvm_ffi(kernel, args: tuple, dump_dir: Path):
    """``cute.compile`` for TVM-FFI calls on sm_90a, keeping the PTX (the DSL writes its own copy into
    ``dump_dir``)."""
    _, cute = import_dsl()
    return cute.compile(
        kernel, *args, options=f"--enable-tvm-ffi --gpu-arch {TARGET_ARCH} --keep-ptx --dump-dir {dump_dir}"
    )


def _load_object(cute, object_path: Path, digest_path: Path, function_name: str):
    """The exported function from a cache entry, or None when the entry is missing or damaged."""
    if not (object_path.exists() and digest_path.exists()):
        return None
    if disk_cache.sha256(object_path) != digest_path.read_text().strip():
        return None
    try:
        return cute.runtime.load_module(str(object_path), enable_tvm_ffi=True)[function_name]
    except Exception:
        return None


def variant_lock(entry: Path, name: str) -> Path:
    """The lock file of variant ``name`` in cache entry ``entry``: held while it is loaded or built."""
    return entry / f".{name}.lock"


def build_or_load(
    name: str, d_qk: int, compile_fn, function_name: str, stats: CacheStats, precision: str = "default"
) -> Variant:
    """Load kernel ``name`` from the disk cache, or build it (``compile_fn(dump_dir)`` returns the JIT
    object) and cache it; every kernel family of the package goes through here."""
    cutlass, cute = import_dsl()
    entry = disk_cache.cache_dir() / _cache_key(cutlass.__version__)
    entry.mkdir(parents=True, exist_ok=True)
    object_path, digest_path, ptx_path = (entry / f"{name}{ext}" for ext in (".o", ".sha256", ".ptx"))
    start = time.perf_counter()
    with _compile_lock, disk_cache.file_lock(variant_lock(entry, name)):
        function = _load_object(cute, object_path, digest_path, function_name)
        if function is not None:
            stats.hits += 1
            return Variant(
                name, d_qk, precision, function, "cache", time.perf_counter() - start, object_path, ptx_path
            )
        if object_path.exists():
            stats.rebuilt_corrupt += 1
        stats.misses += 1
        disk_cache.announce_build()
        try:
            with tempfile.TemporaryDirectory(dir=entry) as dump_dir:
                compiled = compile_fn(Path(dump_dir))
            tmp_object = entry / f".{name}.{os.getpid()}.o.tmp"
            compiled.export_to_c(object_file_path=str(tmp_object), function_name=function_name)
            disk_cache.write_atomic(digest_path, disk_cache.sha256(tmp_object).encode())
            os.replace(tmp_object, object_path)
            if compiled.__ptx__:
                disk_cache.write_atomic(ptx_path, compiled.__ptx__.encode())
            function = cute.runtime.load_module(str(object_path), enable_tvm_ffi=True)[function_name]
        except Exception as exc:
            # One line naming the variant; the DSL's full report (often pages of MLIR) goes to a file
            # next to the cache entry, not into the traceback.
            log_path = entry / f"{name}.error.txt"
            disk_cache.write_atomic(log_path, "".join(traceback.format_exception(exc)).encode())
            first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            error = KernelCompileError(
                f"q8kv8: building kernel variant {name} for {TARGET_ARCH} failed: "
                f"{type(exc).__name__}: {first_line} (full report: {log_path})"
            )
            error.log_path = log_path
            raise error from None
        seconds = time.perf_counter() - start
        disk_cache.announce_built(name, seconds)
    return Variant(name, d_qk, precision, function, "compiled", seconds, object_path, ptx_path)


@dataclass
class PtxasReport:
    """What ptxas says about a variant's PTX (the DSL's own build of the same PTX)."""

    registers: int
    stack_frame_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int
    text: str


def ptxas_version() -> str | None:
    """What ``ptxas --version`` prints for the ptxas on PATH (None when there is none), asked once per
    process and ptxas."""
    ptxas = shutil.which("ptxas")
    return None if ptxas is None else _ptxas_version(ptxas)


@functools.cache
def _ptxas_version(ptxas: str) -> str:
    return subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip()


def ptxas_report(variant: Variant) -> PtxasReport | None:
    """What ``ptxas -v`` says about the variant's kept PTX (None when ptxas is not on PATH).

    ptxas takes a fraction of a second a variant, so its output is kept beside the PTX
    (``<name>.ptxas.json``, with the PTX's SHA-256 and the ptxas version it came from) and read back by
    later listings, in this process or another, for the same PTX and ptxas."""
    ptxas = shutil.which("ptxas")
    if ptxas is None or variant.ptx_path is None or not variant.ptx_path.exists():
        return None
    key = {"ptx_sha256": disk_cache.sha256(variant.ptx_path), "ptxas": _ptxas_version(ptxas)}
    kept_path = variant.ptx_path.with_suffix(".ptxas.json")
    try:
        kept = json.loads(kept_path.read_text())
    except (OSError, ValueError):
        kept = {}
    if isinstance(kept, dict) and kept.get("key") == key and isinstance(kept.get("text"), str):
        text = kept["text"]
    else:
        result = subprocess.run(
            [ptxas, f"-arch={TARGET_ARCH}", "-v", str(variant.ptx_path), "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
        text = result.stdout + result.stderr
        with contextlib.suppress(OSError):  # an unwritable entry: ptxas runs again next time
            disk_cache.write_atomic(kept_path, json.dumps({"key": key, "text": text}).encode())

    def number(pattern: str) -> int:
        match = re.search(pattern, text)
        if match is None:
            raise RuntimeError(f"ptxas -v output has no {pattern!r}:\n{text}")
        return int(match.group(1))

    return PtxasReport(
        registers=number(r"Used (\d+) registers"),
        stack_frame_bytes=number(r"(\d+) bytes stack frame"),
        spill_store_bytes=number(r"(\d+) bytes spill stores"),
        spill_load_bytes=number(r"(\d+) bytes spill loads"),
        text=text,
    )
