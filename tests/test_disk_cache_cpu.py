"""The disk cache (``q8kv8.disk_cache``) when its directory cannot be used: a path that cannot be created
(under ``/proc``, or under a regular file) or a directory that exists but cannot be written (``/proc``
itself; real file-system refusals, so the tests hold when run as root). ``import q8kv8`` works there, one
warning says the cache is off and why, and builds go to a private temporary directory removed at exit."""

import os
import subprocess
import sys
import textwrap
import threading
import warnings
from pathlib import Path

import pytest

from q8kv8 import disk_cache

CANNOT_CREATE = "/proc/q8kv8-cache/kernels"  # procfs refuses new directories, even to root
CANNOT_WRITE = "/proc"  # exists; procfs refuses new files, even to root


@pytest.fixture
def fresh_resolution(monkeypatch):
    """No cache directory resolved yet in this process (restored afterwards)."""
    monkeypatch.setattr(disk_cache, "_directories", {})


def unusable_dirs(tmp_path) -> list[str]:
    regular_file = tmp_path / "a-file"
    regular_file.write_text("")
    return [CANNOT_CREATE, CANNOT_WRITE, str(regular_file / "cache")]


def test_usable_directory_is_created_and_used(monkeypatch, fresh_resolution, tmp_path):
    configured = tmp_path / "new" / "cache"
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(configured))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk_cache.cache_dir() == configured
    assert configured.is_dir() and disk_cache.cache_enabled()
    assert list(configured.iterdir()) == []  # the write probe is gone


@pytest.mark.parametrize("which", range(3))
def test_unusable_directory_warns_once_and_builds_privately(monkeypatch, fresh_resolution, tmp_path, which):
    configured = unusable_dirs(tmp_path)[which]
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, configured)
    with pytest.warns(RuntimeWarning) as caught:
        directory = disk_cache.cache_dir()
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"q8kv8: cache off: {configured} cannot be created or written (")
    assert "Error: " in message and str(directory) in message
    assert directory != Path(configured) and directory.is_dir() and not disk_cache.cache_enabled()
    (directory / "probe").write_bytes(b"x")  # writable
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # resolved once: no second warning
        assert disk_cache.cache_dir() == directory


def test_import_and_builds_work_without_a_usable_cache(tmp_path):
    """A fresh interpreter: ``import q8kv8`` (kernels deferred to keep the test short), then a kernel
    variant and the C++ fast path built into the private directory, which is gone after exit."""
    script = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always")
        import q8kv8
        from q8kv8 import disk_cache, kernels, native
        variant = kernels.load(kernels.QCastKey(512))
        assert variant.source == "compiled", variant
        assert variant.object_path.parent.parent == disk_cache.cache_dir()
        assert native.load() is not None
        print("PRIVATE", disk_cache.cache_dir())
        """
    )
    for configured in (CANNOT_CREATE, CANNOT_WRITE):
        environment = {**os.environ, "Q8KV8_CACHE_DIR": configured, "Q8KV8_COMPILE_AT_IMPORT": "0"}
        result = subprocess.run(
            [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr
        warning_lines = [line for line in result.stderr.splitlines() if "RuntimeWarning" in line]
        assert len(warning_lines) == 1 and "q8kv8: cache off: " in warning_lines[0], result.stderr
        private = Path(result.stdout.split("PRIVATE ", 1)[1].strip())
        assert not private.exists()  # removed at exit


def test_a_build_waits_only_for_the_same_variant(tmp_path, monkeypatch, fresh_resolution):
    """While another holder has variant A's lock (another process building it), building variant B goes
    ahead and building A waits for the lock: processes build different variants at once. The stand-in
    compile exports a file that is no object, so each build ends in its one-line build error."""
    from q8kv8 import build

    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path))
    cutlass, _ = build.import_dsl()
    entry = disk_cache.cache_dir() / build._cache_key(cutlass.__version__)
    entry.mkdir(parents=True)

    class NotAnObject:
        __ptx__ = ""

        def export_to_c(self, object_file_path, function_name):
            Path(object_file_path).write_bytes(b"not an object file")

    def build_variant(name, ended):
        with pytest.raises(build.KernelCompileError, match=name):
            build.build_or_load(name, 512, lambda dump_dir: NotAnObject(), "f", build.CacheStats())
        ended.set()

    a_ended, b_ended = threading.Event(), threading.Event()
    with disk_cache.file_lock(build.variant_lock(entry, "variant_a")):
        threading.Thread(target=build_variant, args=("variant_b", b_ended), daemon=True).start()
        assert b_ended.wait(60), "a build of B waited for A's lock"
        threading.Thread(target=build_variant, args=("variant_a", a_ended), daemon=True).start()
        assert not a_ended.wait(1.0), "a build of A did not wait for A's lock"
    assert a_ended.wait(60), "a build of A did not go ahead once A's lock was released"
