"""The outputs of an allocating call, made in C++ (``csrc/output_alloc.cc``) on the fast path.

Why: an eager call without output buffers allocates ``out``, ``max_logits`` and ``lse``. Three
``Tensor.new_empty`` calls from Python cost about 10 us of host time on the CPU (argument parsing and
wrapping, before the caching allocator's own work), more than the fast launch itself; one call into this
small CPython extension makes the same three tensors with ``at::empty`` in about 3 us.

What: ``allocate(q, d_v)`` returns new ``(out, max_logits, lse)`` ([s_q, h, d_v] bfloat16, [s_q, h]
float32, [s_q, h] float32 on q's device: exactly ``ops.output_buffers``'s tensors) when ``q`` is a 3-d
``torch.Tensor`` or ``torch.nn.Parameter`` (no other subclass), else ``(None, None, None)``. Until
``load`` has built the extension (``import q8kv8`` calls it with the kernels' build, and the first launch on
a GPU when that is deferred) and whenever it cannot be built, ``allocate`` is the Python equivalent; the
fast path takes its allocating calls either way.

Building: ``c++`` against the running torch's headers and libraries and Python's headers (about 20 s,
once per torch and Python version), cached under ``kernels.cache_dir()``; without a compiler or
``Python.h`` it stays on the Python allocation (a warning says so).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "output_alloc.cc"
MODULE_NAME = "_q8kv8_output_alloc"
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # what torch's THPVariable_CheckExact accepts


def allocate_in_python(q, d_v: int):
    """``allocate``'s Python equivalent: ``ops.output_buffers`` for a plain 3-d tensor, else Nones."""
    if type(q) in _PLAIN_TENSOR_TYPES and q.dim() == 3:
        from q8kv8 import ops

        return ops.output_buffers(q, q.shape[1], d_v)
    return None, None, None


allocate = allocate_in_python
"""The per-call allocation: the extension's ``allocate`` once ``load`` has built it."""

_extension = None
_build_failed = False
_lock = threading.Lock()


def _build_dir() -> Path:
    from q8kv8 import native_build

    environment = f"torch={torch.__version__};python={sys.implementation.cache_tag}"
    return native_build.cache_directory("output_alloc", SOURCE, environment)


def _compile(directory: Path) -> Path:
    """The extension in ``directory``, built against torch's and Python's headers when absent."""
    library = directory / (MODULE_NAME + importlib.machinery.EXTENSION_SUFFIXES[0])
    if library.exists():  # built: skip importing torch.utils.cpp_extension (setuptools, ~90 ms)
        return library
    from torch.utils import cpp_extension

    from q8kv8 import native_build

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    flags = [
        "-std=c++20",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        f"-I{sysconfig.get_paths()['include']}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', True))}",
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
    ]
    return native_build.build_library(directory, library.name, SOURCE.read_text(), flags)


def _import(library: Path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The built extension (built on first use; ``allocate`` becomes its function), or None when it cannot
    be built (warned once)."""
    global _extension, _build_failed, allocate
    if _extension is not None or _build_failed:
        return _extension
    with _lock:
        if _extension is None and not _build_failed:
            try:
                _extension = _import(_compile(_build_dir()))
                allocate = _extension.allocate
            except Exception as exc:  # no compiler, no Python.h: allocations stay in Python
                from q8kv8 import native_build

                _build_failed = True
                consequence = "allocating calls allocate in Python"
                native_build.warn_unavailable("C++ output allocation", consequence, exc)
    return _extension
