"""The fast launch: a call's checks and launch in C++ (``csrc/fast_launch.cc``).

Why: the Python path of a call (``contract.check_inputs``, memoised, plus ``kernels.launch_sparse_prefill``)
costs 10-15 us of host time before the kernel's own TVM-FFI call (about 6 us): reading the nine tensors'
signatures alone is ~6 us of Python attribute reads. The C++ checks read the same facts from DLPack views
of the torch tensors and call the kernel variant's TVM-FFI function directly (same arguments, same stream:
torch's current one). The views come from ``q8kv8.fast_call``'s CPython extension, which reads the torch
tensors itself and calls these checks through their C interface (``csrc/fast_launch_c_api.h``); where that
extension cannot be built, from TVM-FFI's conversion of the arguments of one TVM-FFI call
(``q8kv8_fast_launch``).

When: ``api.sparse_mla_q8kv8_prefill_fwd`` offers it every eager call (not while ``torch.compile`` traces,
not with ``Q8KV8_CHECK_RANGES=1``, not while ``kernels.tiles_per_cta_override`` is set) and falls back to the
Python path whenever it declines. It declines (returns -1, launches nothing) for anything outside the common
case: invalid calls (the Python path raises their message), head counts that need padding, tensors that
need copies for alignment, empty extents, scalars of other Python types, and every device the Python path
has not launched on yet, with a kernel variant it has not launched yet: ``kernels.launch_sparse_prefill``
registers both after its launches (``note_launch``: the contract has then checked the device's capability),
and only when one GPU is visible (the kernel launches on the current device; the Python path switches
devices for a tensor on another one).

It is stricter than the contract, never looser: ``tests/test_fast_launch.py`` compares its verdicts with
the Python contract's over valid calls and every violation the contract tests exercise.

Building: ``c++`` against TVM-FFI's headers (about 3 s), cached under ``disk_cache.cache_dir()``; without a
C++ compiler the fast path is off (a warning says so) and every call takes the Python path.
"""

from __future__ import annotations

import atexit
import sys
import threading
import types
from pathlib import Path

import torch

from q8kv8 import fast_call
from q8kv8.metadata import D_V

SOURCE = Path(__file__).resolve().parent / "csrc" / "fast_launch.cc"
EXPORTED = (
    "q8kv8_fast_configure",
    "q8kv8_fast_register_variant",
    "q8kv8_fast_register_device",
    "q8kv8_fast_reset",
    "q8kv8_fast_plan",
    "q8kv8_fast_launch",
    "q8kv8_fast_take_launch_error",
    "q8kv8_fast_decline_reason",
    "q8kv8_fast_c_api",
    "q8kv8_fast_rethrow",
)
KDL_CUDA = 2  # DLPack's device type of CUDA tensors

launch = None
"""The per-call fast path once a device is registered, else None (the entry point's test): called with the
public call's 13 arguments, it returns ``(out, max_logits, lse)`` after launching, or None having launched
nothing. ``fast_call``'s extension's ``launch``, or ``launch_through_tvm_ffi`` when that is not built."""

_module = None
_build_failed = False
_registered_devices: set[int] = set()
_registered: set[tuple] = set()  # (device index, d_qk, precision, persistent) seen by note_launch
_lock = threading.Lock()


def _build_dir() -> Path:
    import tvm_ffi

    from q8kv8 import native_build

    environment = f"tvm_ffi={tvm_ffi.__version__};python={sys.version_info[:2]}"
    return native_build.cache_directory("fast_launch", SOURCE, environment)


def _compile(directory: Path) -> Path:
    """``fast_launch.so`` in ``directory``, built with ``c++`` against TVM-FFI's headers when absent."""
    import tvm_ffi.libinfo

    from q8kv8 import native_build

    exports = "".join(f"TVM_FFI_DLL_EXPORT_TYPED_FUNC({name}, {name});\n" for name in EXPORTED)
    lib_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    flags = [
        "-std=c++17",
        f"-I{native_build.C_API_HEADER.parent}",
        f"-I{tvm_ffi.libinfo.find_include_path()}",
        f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}",
        f"-L{lib_dir}",
        "-ltvm_ffi",
    ]
    return native_build.build_library(directory, "fast_launch.so", SOURCE.read_text() + "\n" + exports, flags)


def load():
    """The built module (built on first use), or None when it cannot be built (warned once)."""
    global _module, _build_failed
    if _module is not None or _build_failed:
        return _module
    with _lock:
        if _module is None and not _build_failed:
            try:
                import tvm_ffi

                library = tvm_ffi.load_module(str(_compile(_build_dir())))
                module = types.SimpleNamespace()
                for name in EXPORTED:
                    function = library[name]
                    # Keep the GIL: the calls are short, and every call into the module is then serialised
                    # (registration never races a launch reading the registry).
                    function.release_gil = False
                    setattr(module, name, function)
                _configure(module)
                _module = module
                # Release the registered tensors and functions while the interpreter is still alive.
                atexit.register(module.q8kv8_fast_reset)
            except Exception as exc:  # no compiler, no headers: the Python path takes every call
                from q8kv8 import native_build

                _build_failed = True
                native_build.warn_unavailable("C++ fast launch", "every call takes the Python path", exc)
    return _module


def _configure(module) -> None:
    from q8kv8 import metadata, schedule

    module.q8kv8_fast_configure(
        metadata.LOG2_E,
        metadata.Q_ALIGNMENT_BYTES,
        metadata.KV_ROW_ALIGNMENT_BYTES,
        metadata.OUT_ALIGNMENT_BYTES,
        schedule.PERSISTENT_MAX_TOPK,
        schedule.PERSISTENT_MAX_TILES_PER_CTA,
        schedule.PERSISTENT_MIN_WAVES,
        "default" in schedule.PERSISTENT_PRECISIONS,
        "accurate" in schedule.PERSISTENT_PRECISIONS,
    )


def register(module, device_type: int, device_index: int, sm_count: int) -> None:
    """Let ``module`` launch on one device, given its multiprocessor count."""
    module.q8kv8_fast_register_device(device_type, device_index, sm_count)


def note_launch(
    device_index: int, gpu_count: int, d_qk: int, precision: str, persistent: bool, function
) -> None:
    """Called by ``kernels.launch_sparse_prefill`` after each launch of the Python path: the first launch on
    a CUDA device registers the device, the first of each kernel variant registers the variant, and from
    then on the fast path may take such calls (with one visible GPU only)."""
    global launch
    key = (device_index, d_qk, precision, persistent)
    if key in _registered or gpu_count != 1 or device_index < 0:
        return
    module = load()
    if module is None:
        return
    if device_index not in _registered_devices:
        from q8kv8 import schedule

        sm_count = schedule._sm_counts.get(device_index)
        if sm_count is None:
            sm_count = torch.cuda.get_device_properties(device_index).multi_processor_count
        register(module, KDL_CUDA, device_index, sm_count)
        _registered_devices.add(device_index)
    module.q8kv8_fast_register_variant(d_qk, precision == "accurate", persistent, function)
    _registered.add(key)
    launch = _per_call_launch(module)


def _per_call_launch(module):
    """``fast_call``'s ``launch``, bound to ``module``'s C interface (built once), else the TVM-FFI call."""
    extension = fast_call.load()
    if extension is None:
        return launch_through_tvm_ffi
    extension.bind(module.q8kv8_fast_c_api(), module.q8kv8_fast_rethrow)
    return extension.launch


def launch_through_tvm_ffi(
    q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse, precision
):
    """``fast_call``'s ``launch`` through one TVM-FFI call (``q8kv8_fast_launch``), allocating in Python."""
    if out is None and max_logits is None and lse is None:
        # Nones unless q is a plain 3-d tensor.
        out, max_logits, lse = fast_call.allocate_in_python(q, D_V)
    try:
        schedule = _module.q8kv8_fast_launch(
            q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse,
            precision,
        )  # fmt: skip
    except Exception:
        if take_launch_error():  # raised by the launch itself
            raise
        return None  # TVM-FFI could not convert an argument: the Python path says what is wrong
    return (out, max_logits, lse) if schedule >= 0 else None


def disable() -> None:
    """Forget every registered device (tests)."""
    global launch
    launch = None
    _registered_devices.clear()
    _registered.clear()
    if _module is not None:
        _module.q8kv8_fast_reset()
        _configure(_module)


def decline_reason(
    q,
    kv,
    indices,
    sm_scale,
    q_scale,
    kv_scale,
    d_v=512,
    attn_sink=None,
    topk_length=None,
    out=None,
    max_logits=None,
    lse=None,
    precision="default",
) -> str:
    """Why the fast path declines a call with these arguments ("" when it takes it): a diagnostic for a
    call that is slower than expected. (``fast_call``'s extension also declines tensors it cannot read
    directly: subclasses other than Parameter, wrapper or Python-dispatch tensors, negative or conjugate
    views.)"""
    module = load()
    if module is None:
        return "the fast launch is unavailable (it did not build)"
    if launch is None:
        return "no device registered yet (the first call on a GPU registers it)"
    if out is None and max_logits is None and lse is None:  # an allocating call: checked with its outputs
        out, max_logits, lse = fast_call.allocate_in_python(q, D_V)
    return str(
        module.q8kv8_fast_decline_reason(
            q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse,
            precision,
        )
    )  # fmt: skip


def take_launch_error() -> bool:
    """Whether the exception just raised by ``launch`` came from the kernel's launch itself (re-raise it)
    rather than from converting the arguments before any check ran (let the Python path take the call)."""
    return _module is not None and bool(_module.q8kv8_fast_take_launch_error())
