"""The eager fast path from Python to the kernel launch in one CPython call (``csrc/fast_call.cc``).

Why: a call through TVM-FFI (``fast_launch.q8kv8_fast_launch``) first turns each torch tensor argument into
a TVM-FFI tensor through DLPack (about 0.3 us per tensor on the CPU dev machine, twice that on the GPU
host: 4-6 us for a call's nine), and an allocating call made its three outputs with ``at::empty`` through
the dispatcher before that (7.4 us on the GPU host). This small CPython extension, built against torch,
reads the tensors' TensorImpls directly into DLPack views, asks ``csrc/fast_launch.cc``'s checks through
their C interface (``csrc/fast_launch_c_api.h``), allocates the outputs of an allocating call with the
allocator ``at::empty`` uses (without the dispatcher), and launches the kernel variant on torch's current
stream, as the TVM-FFI call did.

What:

- ``launch(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse,
  precision)`` returns ``(out, max_logits, lse)`` (new tensors when none is given, else the given ones)
  after launching, or None having launched nothing (the Python path then takes the call). It is
  ``fast_launch.launch`` once a device is registered and this extension is built.
- ``allocate(q, d_v)``: new ``(out, max_logits, lse)`` ([s_q, h, d_v] bfloat16, [s_q, h] float32, [s_q, h]
  float32 on q's device: exactly ``ops.output_buffers``'s tensors) when ``q`` is a 3-d ``torch.Tensor`` or
  ``torch.nn.Parameter`` (no other subclass), else ``(None, None, None)``; ``allocate_in_python`` is its
  Python equivalent (the TVM-FFI fallback's allocation).

Building: ``c++`` against the running torch's headers and libraries, Python's headers and DLPack's header
(TVM-FFI's copy), about 20 s once per torch and Python version, cached under ``disk_cache.cache_dir()``;
without a compiler or ``Python.h`` the fast path calls ``fast_launch.q8kv8_fast_launch`` through TVM-FFI
instead (a warning says so).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import sysconfig
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "fast_call.cc"
MODULE_NAME = "_q8kv8_fast_call"
_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)  # what torch's THPVariable_CheckExact accepts


def allocate_in_python(q, d_v: int):
    """``allocate``'s Python equivalent: ``ops.output_buffers`` for a plain 3-d tensor, else Nones."""
    if type(q) in _PLAIN_TENSOR_TYPES and q.dim() == 3:
        from q8kv8 import ops

        return ops.output_buffers(q, q.shape[1], d_v)
    return None, None, None


_extension = None
_build_failed = False
_lock = threading.Lock()


def _build_dir() -> Path:
    import tvm_ffi

    from q8kv8 import native_build

    environment = (
        f"torch={torch.__version__};python={sys.implementation.cache_tag};tvm_ffi={tvm_ffi.__version__}"
    )
    return native_build.cache_directory("fast_call", SOURCE, environment)


def _compile(directory: Path) -> Path:
    """The extension in ``directory``, built against torch's, Python's and DLPack's headers when absent."""
    library = directory / (MODULE_NAME + importlib.machinery.EXTENSION_SUFFIXES[0])
    if library.exists():  # built: skip importing torch.utils.cpp_extension (setuptools, ~90 ms)
        return library
    import tvm_ffi.libinfo
    from torch.utils import cpp_extension

    from q8kv8 import native_build

    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    flags = [
        "-std=c++20",
        f"-I{native_build.C_API_HEADER.parent}",
        f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}",
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
    """The built extension (built on first use), or None when it cannot be built (warned once)."""
    global _extension, _build_failed
    if _extension is not None or _build_failed:
        return _extension
    with _lock:
        if _extension is None and not _build_failed:
            try:
                _extension = _import(_compile(_build_dir()))
            except Exception as exc:  # no compiler, no Python.h: calls go through TVM-FFI
                from q8kv8 import native_build

                _build_failed = True
                consequence = "fast calls go through TVM-FFI and allocate in Python"
                native_build.warn_unavailable("C++ fast call", consequence, exc)
    return _extension
