"""Building q8kv8's C++ extension (``csrc/``) with the system's C++ compiler (``$CXX``, else
``c++`` or ``g++``), cached on disk.

``build_library`` compiles one source file into a shared library in a cache directory that the caller
names by a digest of everything the binary depends on (the source, the headers' package versions, the
Python version), so a library is built once per machine and environment and only loaded afterwards. A build
says so on stderr (``disk_cache.announce_build``) and, when done, names the library and its seconds.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

from q8kv8 import disk_cache


def cache_directory(kind: str, source: Path, environment: str) -> Path:
    """The cache directory of a library built from ``source`` for ``environment`` (the versions of what it
    is compiled and linked against): ``disk_cache.cache_dir() / kind / digest``."""
    digest = hashlib.sha256(source.read_bytes())
    digest.update(environment.encode())
    return disk_cache.cache_dir() / kind / digest.hexdigest()[:24]


def warn_unavailable(what: str, consequence: str, exc: Exception) -> None:
    """The one warning a failed build gives: what is unavailable, what happens instead, and why."""
    first_line = (str(exc).strip().splitlines() or [""])[0]
    warnings.warn(
        f"q8kv8: the {what} is unavailable, {consequence} ({type(exc).__name__}: {first_line})",
        RuntimeWarning,
        stacklevel=3,
    )


def build_library(directory: Path, library_name: str, source_text: str, flags: list[str]) -> Path:
    """``directory / library_name``, built from ``source_text`` when absent: ``c++ -O2 -fPIC -shared``
    with ``flags`` (include paths, libraries, defines), written under a temporary name and renamed into
    place under a file lock, so concurrent processes build it once. Raises RuntimeError with the
    compiler's message when there is no compiler or the build fails."""
    library = directory / library_name
    directory.mkdir(parents=True, exist_ok=True)
    with disk_cache.file_lock(directory / ".lock"):
        if library.exists():
            return library
        compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")
        disk_cache.announce_build()
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=directory) as work:
            source = Path(work) / (Path(library_name).stem + ".cc")
            source.write_text(source_text)
            output = Path(work) / library_name
            command = [compiler, "-O2", "-fPIC", "-shared", str(source), "-o", str(output), *flags]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
            os.replace(output, library)
        disk_cache.announce_built(library_name.split(".", 1)[0], time.perf_counter() - start)
    return library
