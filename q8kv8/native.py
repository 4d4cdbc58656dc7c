"""The eager fast path: a C++ extension (``csrc/native.cc``) that checks, allocates and launches a call.

Why: the Python path (``contract.check_inputs`` plus ``kernels.launch_sparse_prefill``) spends microseconds
of Python on every call; the extension reads the torch tensors directly and does the same in one CPython
call. ``q8kv8.eager`` offers it every eager call once the Python path has launched on the device
(``note_launch``) and takes the Python path whenever it declines. Built with ``c++`` against torch, Python
and TVM-FFI, cached under ``disk_cache.cache_dir()``; where it cannot be built, one warning says so and
every call takes the Python path.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import importlib.machinery
import importlib.util
import sys
import sysconfig
import threading
from pathlib import Path

import torch

from q8kv8 import contract, metadata, native_build, schedule
from q8kv8.prefill_call import PrefillCall

SOURCE = Path(__file__).resolve().parent / "csrc" / "native.cc"
MODULE_NAME = "_q8kv8_native"
KDL_CUDA = 2  # DLPack's device type of CUDA tensors

launch = None
"""The extension's ``launch`` once a device and a kernel variant are registered, else None (also while
``suspended``): called with a PrefillCall, it returns ``(out, max_logits, lse)`` having launched, or None
having launched nothing."""

_extension = None
_build_failed = False
_lock = threading.Lock()  # the extension's build and import
_registration_lock = threading.Lock()
_registered: set[tuple] = set()  # (device, d_qk, precision, schedule kind, q dtype) registered by note_launch
_registered_devices: set[int] = set()
_suspended = 0
_resumed_launch = None  # what ``launch`` becomes when the outermost ``suspended`` ends
_gpu_count: int | None = None  # visible GPUs, counted on the first note_launch
_ffi_function_type: type | None = None  # tvm_ffi.Function, once ``load`` has imported TVM-FFI


def constants() -> dict:
    """What the extension's checks compare against: every constant from its one Python definition."""
    import tvm_ffi

    error_kinds = {
        name: value
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    error_kinds.update(getattr(tvm_ffi.core, "ERROR_NAME_TO_TYPE", {}))  # kinds registered with TVM-FFI
    return {
        "fields": PrefillCall._fields,
        "supported_d_qk": metadata.SUPPORTED_D_QK,
        "small_head_counts": metadata.SMALL_HEAD_COUNTS,
        "q_dtypes": metadata.Q_DTYPES,
        "row_scaled_q_dtypes": metadata.ROW_SCALED_Q_DTYPES,
        "d_v": metadata.D_V,
        "precisions": metadata.PRECISIONS,
        "head_alignment": metadata.HEAD_ALIGNMENT,
        "topk_alignment": metadata.TOPK_ALIGNMENT,
        "q_alignment_bytes": metadata.Q_ALIGNMENT_BYTES,
        "kv_row_alignment_bytes": metadata.KV_ROW_ALIGNMENT_BYTES,
        "out_alignment_bytes": metadata.OUT_ALIGNMENT_BYTES,
        "log2_e": metadata.LOG2_E,
        "topk_length_flag": metadata.TOPK_LENGTH_FLAG,
        "sink_flag": metadata.SINK_FLAG,
        "split_tail_flag": metadata.SPLIT_TAIL_FLAG,
        "persistent_max_topk": schedule.PERSISTENT_MAX_TOPK,
        "persistent_max_tiles_per_cta": schedule.PERSISTENT_MAX_TILES_PER_CTA,
        "small_head_max_tiles_per_cta": schedule.SMALL_HEAD_MAX_TILES_PER_CTA,
        "small_head_split_min_parts": schedule.SMALL_HEAD_SPLIT_MIN_PARTS,
        "persistent_min_waves": schedule.PERSISTENT_MIN_WAVES,
        "split_parts": schedule.SPLIT_PARTS,
        "split_cluster_sms": schedule.SPLIT_CLUSTER_SMS,
        "split_min_slots": schedule.SPLIT_MIN_SLOTS,
        "split_tail_min_topk": schedule.SPLIT_TAIL_MIN_TOPK,
        "error_kinds": error_kinds,
    }


def _build_dir() -> Path:
    import tvm_ffi

    environment = (
        f"torch={torch.__version__};python={sys.implementation.cache_tag};tvm_ffi={tvm_ffi.__version__}"
    )
    return native_build.cache_directory("native", SOURCE, environment)


def _compile(directory: Path) -> Path:
    """The extension in ``directory``, built against torch's, Python's and TVM-FFI's headers when absent.

    torch's include directories are those of ``torch.utils.cpp_extension.include_paths()``, named here:
    importing that module costs setuptools and, with a CUDA build of torch and no GPU, prints a warning
    about CUDA_HOME that has nothing to do with this CPU-side build."""
    library = directory / (MODULE_NAME + importlib.machinery.EXTENSION_SUFFIXES[0])
    if library.exists():
        return library
    import tvm_ffi.libinfo

    torch_root = Path(torch.__file__).resolve().parent
    torch_include, torch_lib = torch_root / "include", torch_root / "lib"
    tvm_ffi_lib = Path(tvm_ffi.libinfo.find_libtvm_ffi()).resolve().parent
    flags = [
        "-std=c++20",
        f"-I{tvm_ffi.libinfo.find_include_path()}",
        f"-I{tvm_ffi.libinfo.find_dlpack_include_path()}",
        f"-I{torch_include}",
        f"-I{torch_include / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', True))}",
        f"-L{torch_lib}",
        f"-Wl,-rpath,{torch_lib}",
        f"-L{tvm_ffi_lib}",
        f"-Wl,-rpath,{tvm_ffi_lib}",
        "-lc10",
        "-ltorch",
        "-ltorch_cpu",
        "-ltorch_python",
        "-ltvm_ffi",
    ]
    return native_build.build_library(directory, library.name, SOURCE.read_text(), flags)


def _import(library: Path):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load():
    """The built extension, configured (built on first use), or None when it cannot be built (warned once)."""
    global _extension, _build_failed, _ffi_function_type
    if _extension is not None or _build_failed:
        return _extension
    with _lock:
        if _extension is None and not _build_failed:
            try:
                import tvm_ffi  # loads libtvm_ffi, which the extension shares

                extension = _import(_compile(_build_dir()))
                extension.configure(constants())
                # Release the registered kernel variants while the interpreter is still alive.
                atexit.register(extension.reset)
                _ffi_function_type = tvm_ffi.Function
                _extension = extension
            except Exception as exc:  # no compiler, no Python.h: every call takes the Python path
                _build_failed = True
                native_build.warn_unavailable("C++ fast path", "every call takes the Python path", exc)
    return _extension


def register_variant(
    extension,
    d_qk: int,
    precision: str,
    schedule_kind: int,
    function,
    q_dtype: torch.dtype = torch.float8_e4m3fn,
    heads: int = metadata.HEAD_ALIGNMENT,
) -> None:
    """Let ``extension`` launch ``function`` (a ``tvm_ffi.Function``: the kernel variant the Python path
    launches for ``d_qk``, ``precision``, the schedule kind (``schedule.ONE_TILE``, ``PERSISTENT`` or
    ``SPLIT``), a q of ``q_dtype`` and tiles of ``heads`` heads: 64, or a small-head count, whose variant is
    persistent); it holds a reference until replaced or reset."""
    extension.register_variant(d_qk, precision, schedule_kind, function.__chandle__(), q_dtype, heads)


def note_launch(
    device_index: int,
    d_qk: int,
    precision: str,
    schedule_kind: int,
    variant,
    q_dtype: torch.dtype = torch.float8_e4m3fn,
    heads: int = metadata.HEAD_ALIGNMENT,
) -> None:
    """Called by the Python path after each launch on a CUDA device (whose capability the contract has then
    checked): the first launch on the device registers it, the first of each kernel variant (``variant``,
    a ``kernels.Variant``, for a q of ``q_dtype``, a schedule kind of ``schedule`` and tiles of ``heads``
    heads) registers the variant, and from then on ``launch`` takes such calls. Only with one visible GPU
    (the extension launches on the current device), never while ``suspended``, and only for a variant that is
    a ``tvm_ffi.Function`` (the compiled kernels are)."""
    key = (device_index, d_qk, precision, schedule_kind, q_dtype, heads)
    if key in _registered or _suspended or device_index < 0:
        return
    with _registration_lock:
        _register(key, variant)


def _register(key: tuple, variant) -> None:
    """``note_launch``'s registration of ``key`` (one thread at a time)."""
    global launch, _gpu_count
    device_index, d_qk, precision, schedule_kind, q_dtype, heads = key
    if key in _registered:
        return
    if _gpu_count is None:
        _gpu_count = torch.cuda.device_count()
    extension = load() if _gpu_count == 1 else None
    if extension is None or not isinstance(variant.function, _ffi_function_type):
        return
    if device_index not in _registered_devices:
        extension.register_device(KDL_CUDA, device_index, schedule.sm_count(device_index))
        _registered_devices.add(device_index)
    register_variant(extension, d_qk, precision, schedule_kind, variant.function, q_dtype, heads)
    _registered.add(key)
    launch = extension.launch


def disable() -> None:
    """Forget every registered device and variant (tests); the next launch of the Python path registers
    again."""
    global launch, _resumed_launch
    launch = _resumed_launch = None
    _registered.clear()
    _registered_devices.clear()
    if _extension is not None:
        _extension.configure(constants())


@contextlib.contextmanager
def suspended():
    """While active no call takes the extension and nothing is registered; afterwards it takes the calls it
    took before."""
    global launch, _suspended, _resumed_launch
    if not _suspended:
        _resumed_launch = launch
    _suspended += 1
    launch = None
    try:
        yield
    finally:
        _suspended -= 1
        if not _suspended:
            launch, _resumed_launch = _resumed_launch, None


def decline_reason(call: PrefillCall) -> str:
    """Why the fast path leaves ``call`` to the Python path ("" when it takes it): a diagnostic for a call
    that is slower than expected."""
    extension = load()
    if extension is None:
        return "the C++ fast path is unavailable (it did not build)"
    if contract.check_ranges_enabled():
        return f"{contract.CHECK_RANGES_ENV}=1: the range check runs in Python"
    if _suspended:
        return "the fast path is suspended (a forced schedule is active)"
    if launch is None:
        return "no device registered yet (the first call on a GPU registers it)"
    return extension.decline_reason(call)
