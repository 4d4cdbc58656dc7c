"""The on-disk cache of built kernels and host libraries: where it is, and safe writes into it.

Location: ``$Q8KV8_CACHE_DIR``, else ``$XDG_CACHE_HOME/q8kv8`` (``~/.cache/q8kv8``). When that directory
cannot be created or written (a read-only file system, a home that does not exist, no permission), the cache
is off for the process: one warning says so and why, and everything is built into a private temporary
directory that is removed at exit. Writers serialise on a file lock and write each file under a temporary
name that is renamed into place, so concurrent processes never see a partial file. The first build of a
process says so in one line on stderr (``announce_build``), and each finished build in one line naming what
was built and its seconds (``announce_built``); loads are silent.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path

CACHE_DIR_ENV = "Q8KV8_CACHE_DIR"

_announced = False
_directories: dict[Path, Path] = {}  # configured directory -> the directory in use for it
_lock = threading.Lock()


def configured_dir() -> Path:
    """The cache directory the environment asks for (it may not exist or be writable)."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "q8kv8"


def cache_dir() -> Path:
    """The directory builds go to: ``configured_dir()`` when it can be created and written, else this
    process's private temporary directory (warned once per configured directory)."""
    configured = configured_dir()
    directory = _directories.get(configured)
    if directory is None:
        with _lock:
            directory = _directories.get(configured)
            if directory is None:
                directory = _directories[configured] = _usable(configured)
    return directory


def cache_enabled() -> bool:
    """Whether builds persist across processes (the configured directory is usable)."""
    return cache_dir() == configured_dir()


def _usable(configured: Path) -> Path:
    try:
        configured.mkdir(parents=True, exist_ok=True)
        handle, probe = tempfile.mkstemp(dir=configured, prefix=".write-probe-")
        os.close(handle)
        os.unlink(probe)
        return configured
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc.strerror or exc}"
    private = Path(tempfile.mkdtemp(prefix="q8kv8-cache-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    warnings.warn(
        f"q8kv8: cache off: {configured} cannot be created or written ({reason}); this process builds its "
        f"kernels and native libraries in {private}, removed at exit (set {CACHE_DIR_ENV} to a writable "
        "directory to keep them)",
        RuntimeWarning,
        stacklevel=3,
    )
    return private


def announce_build() -> None:
    """Say once per process, on stderr, that something is being built rather than loaded: what, where it is
    cached and about how long it takes (loading says nothing)."""
    global _announced
    if not _announced:
        _announced = True
        print(
            f"q8kv8: building the CuTe DSL kernels and the C++ fast path into {cache_dir()} (about a minute, "
            "once per machine and version; later imports load them)",
            file=sys.stderr,
            flush=True,
        )


def build_announced() -> bool:
    """Whether this process has said that it builds (``announce_build``)."""
    return _announced


def set_build_announced(announced: bool) -> None:
    """Take over another process's ``build_announced()``: a worker of ``python -m q8kv8.compile --jobs``
    does not repeat the announcement its parent made."""
    global _announced
    _announced = announced


def announce_built(name: str, seconds: float) -> None:
    """Say on stderr, in one line, that ``name`` (a kernel variant or a native library) was just built and
    how long it took: the progress of a build (loading says nothing)."""
    print(f"q8kv8: built {name} ({seconds:.1f} s)", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive ``flock`` on ``path`` (created if absent) for the ``with`` block."""
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
