"""The package as a user installs it (CPU test, run in CI). The sdist is built from the tracked files alone
and the wheel from the sdist, as pip builds it from a package index: the wheel holds every module of
``q8kv8`` and ``cute_kernels`` and the C++ source of the fast path, and nothing else. Installed into a fresh
virtual environment, it imports from there (not from this checkout) and builds a kernel for sm_90a.

The environment has no packages of its own but the wheel: a ``.pth`` file lists the folders this interpreter
imports torch, the CuTe DSL, tvm-ffi and cuda-python from, as plain paths, so that the ``.pth`` files there
(an editable install of this checkout among them) are not run."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("q8kv8/", "cute_kernels/")
DEPENDENCIES = ("torch", "cutlass", "tvm_ffi", "cuda")
"""The top-level modules of the wheel's dependencies (``cutlass`` is the CuTe DSL)."""
PIP = (sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input")
KERNEL_MODULES = (  # what the kernel builds import, for sm_90a
    "cute_kernels.sm90.sparse_prefill",
    "cute_kernels.sm90.paged_kv",
    "cute_kernels.sm90.paged_indices",
    "cute_kernels.sm90.paged_rows",
    "cute_kernels.sm90.q_cast",
    "cute_kernels.sm90.sparse_prefill_bf16",
)

CHECK_INSTALLED = """
import importlib, json, os, sys

os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import q8kv8
from q8kv8 import kernels, native

variant = kernels.load(kernels.QCastKey(512))
print(json.dumps({
    "q8kv8": q8kv8.__file__,
    "native_source": str(native.SOURCE),
    "modules": {name: importlib.import_module(name).__file__ for name in sys.argv[1:]},
    "variant": {"name": variant.name, "source": variant.source, "object": str(variant.object_path)},
}))
"""
"""Run by the installed environment's interpreter: the files the package imports and reads, and one kernel
built into the cache (``$Q8KV8_CACHE_DIR``)."""


def run(command, **kwargs) -> str:
    """``command``'s stdout; its output in the assertion message when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def tracked_files() -> list[str]:
    try:
        listing = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout (the package's files are the tracked ones)")
    return [name for name in listing.split("\0") if name]


def package_files() -> set[str]:
    return {name for name in tracked_files() if name.startswith(PACKAGES)}


def dependency_paths() -> list[str]:
    """The folders holding the dependencies' top-level packages, as this interpreter finds them."""
    paths = []
    for name in DEPENDENCIES:
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not installed as a package"
        for location in spec.submodule_search_locations:
            parent = str(Path(location).resolve().parent)
            if parent not in paths:
                paths.append(parent)
    return paths


def require_build_backend() -> None:
    """Skips without the build backend that ``pyproject.toml`` names (the ``dev`` extra installs it): the
    wheel is built offline, with no isolated environment to fetch it into."""
    try:
        import setuptools
    except ImportError:
        pytest.skip("needs setuptools>=77 (pip install -e '.[dev]')")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"needs setuptools>=77 (pip install -e '.[dev]'), found {setuptools.__version__}")


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel, built offline with the setuptools installed here."""
    require_build_backend()
    root = tmp_path_factory.mktemp("dists")
    source = root / "source"
    for name in tracked_files():
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    out = root / "out"
    out.mkdir()
    build_sdist = "import sys, setuptools.build_meta as backend; backend.build_sdist(sys.argv[1])"
    run([sys.executable, "-c", build_sdist, str(out)], cwd=source)
    [sdist] = out.glob("*.tar.gz")
    run(
        [*PIP, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(sdist)],
        cwd=root,
    )
    [wheel] = out.glob("*.whl")
    return {"sdist": sdist, "wheel": wheel}


def test_wheel_holds_the_package_files_and_nothing_else(dists):
    with zipfile.ZipFile(dists["wheel"]) as wheel:
        names = wheel.namelist()
        [metadata] = [name for name in names if name.endswith(".dist-info/METADATA")]
        headers = wheel.read(metadata).decode().split("\n\n", 1)[0].splitlines()
    dist_info = metadata.rpartition("/")[0]
    files = {name for name in names if not name.startswith(dist_info + "/")}
    assert "q8kv8/csrc/native.cc" in files
    assert files == package_files()  # no tests, scripts, probes or benchmark output
    assert f"{dist_info}/licenses/LICENSE" in names
    assert "License-Expression: Apache-2.0" in headers


def test_sdist_holds_the_license_readme_and_project_file(dists):
    with tarfile.open(dists["sdist"]) as sdist:
        top, *_ = sdist.getnames()[0].split("/")
        names = {name.removeprefix(top + "/") for name in sdist.getnames()}
    assert {"LICENSE", "README.md", "pyproject.toml"} <= names
    assert package_files() <= names


def test_sdist_holds_the_docs_the_readme_names(dists):
    """The README is the package's long description: every ``docs/`` page it names is in the sdist (from
    ``MANIFEST.in``), where the name resolves beside the README."""
    named = set(re.findall(r"\bdocs/[\w.-]+\.md\b", (REPO / "README.md").read_text()))
    assert {"docs/usage.md", "docs/kernel.md", "docs/perf-notes.md", "docs/sanitizers.md"} <= named
    assert named <= set(tracked_files())
    with tarfile.open(dists["sdist"]) as sdist:
        top, *_ = sdist.getnames()[0].split("/")
        names = {name.removeprefix(top + "/") for name in sdist.getnames()}
    assert named <= names, sorted(named - names)


def test_installed_wheel_imports_from_its_environment_and_builds_a_kernel(dists, tmp_path):
    cache, workdir, environment = tmp_path / "cache", tmp_path / "work", tmp_path / "venv"
    workdir.mkdir()
    # Nothing of this checkout on the new interpreter's path: no PYTHONPATH, and it runs in another folder.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env.update(Q8KV8_COMPILE_AT_IMPORT="0", Q8KV8_CACHE_DIR=str(cache))
    run([sys.executable, "-m", "venv", str(environment)], cwd=workdir, env=env)
    python = environment / "bin" / "python"
    [site_packages] = run(
        [python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=workdir, env=env
    ).splitlines()
    dependencies = dependency_paths()
    for path in dependencies:
        assert not any((Path(path) / package).exists() for package in PACKAGES), f"{path} holds the package"
    Path(site_packages, "q8kv8_test_dependencies.pth").write_text("\n".join(dependencies) + "\n")
    pip = [python, *PIP[1:]]
    run([*pip, "install", "--no-deps", "--no-index", str(dists["wheel"])], cwd=workdir, env=env)

    # -I: no user site-packages on sys.path either.
    report = json.loads(run([python, "-I", "-c", CHECK_INSTALLED, *KERNEL_MODULES], cwd=workdir, env=env))

    installed = Path(site_packages).resolve()
    for path in [report["q8kv8"], report["native_source"], *report["modules"].values()]:
        assert installed in Path(path).resolve().parents, f"{path} is not the installed wheel's"
    assert Path(report["native_source"]).relative_to(installed).as_posix() == "q8kv8/csrc/native.cc"
    assert Path(report["native_source"]).is_file()
    assert sorted(report["modules"]) == sorted(KERNEL_MODULES)
    variant = report["variant"]
    assert variant["source"] == "compiled", variant  # a new, empty cache: built by the installed package
    assert cache.resolve() in Path(variant["object"]).resolve().parents and Path(variant["object"]).is_file()
