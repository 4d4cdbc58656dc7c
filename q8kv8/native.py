"""The eager fast path: a C++ extension (``csrc/native.cc``) that runs launch plans computed here, once per
kind of call.

Why: the Python path (``contract.check_inputs`` plus ``kernels.launch_sparse_prefill``) spends microseconds
of Python on every call; the extension reads the torch tensors directly and launches in one CPython call.

How: the extension reads a call's arguments into a key (each argument's type; a tensor's dtype, device, shape
and strides, with ``FREE_EXTENTS`` only as zero or not; a scalar's value) and memoises, under it, the plan
that ``launch_plan`` computes here for the first call with that key: the contract's verdict, the schedule
(``q8kv8.schedule``), the kernel variants, arguments and scalars (``kernels.attention_plan``, which the
Python path executes too), the alignments to check (``metadata.LAUNCH_ALIGNMENT_BYTES``) and the outputs
(``metadata.output_layouts``). Every rule lives in Python; the extension keeps only the per-call checks that
depend on the tensors' addresses (the plan's alignments, and no output sharing memory with another argument)
and the launch. ``q8kv8.eager`` offers it every eager call once the Python path has launched on the device
(``note_launch``) and takes the Python path whenever it declines. Built with ``$CXX`` (else ``c++`` or
``g++``) against torch, Python and TVM-FFI, cached under ``disk_cache.cache_dir()``; where it cannot be
built, one warning says so and every call takes the Python path.
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

from q8kv8 import contract, kernels, metadata, native_build, paged, schedule
from q8kv8.prefill_call import PagedCall, PrefillCall

SOURCE = Path(__file__).resolve().parent / "csrc" / "native.cc"
MODULE_NAME = "_q8kv8_native"
FREE_EXTENTS = {"kv": 0}
"""The extents a plan depends on only through being zero or not (the contract's ``s_kv``): keyed so, a kv that
grows from call to call (a serving loop's gathered rows) keeps its plan."""

launch = None
"""The extension's ``launch`` once a device is registered, else None (also while ``suspended``): called with a
PrefillCall or a PagedCall, it returns ``(out, max_logits, lse)`` having launched, or None having launched
nothing."""

_extension = None
_build_failed = False
_lock = threading.Lock()  # the extension's build and import
_registration_lock = threading.Lock()
_devices: dict[torch.device, int] = {}  # the devices plans are made for, with their SM counts
_registered_devices: set[int] = set()  # CUDA device indices registered by note_launch
_suspended = 0
_resumed_launch = None  # what ``launch`` becomes when the outermost ``suspended`` ends
_gpu_count: int | None = None  # visible GPUs, counted on the first note_launch
_ffi_function_type: type | None = None  # tvm_ffi.Function, once ``load`` has imported TVM-FFI
_PREFILL_FIELDS = {name: index for index, name in enumerate(PrefillCall._fields)}
_PAGED_FIELDS = {name: index for index, name in enumerate(PagedCall._fields)}


def constants() -> dict:
    """The extension's configuration (``configure(**constants())``): the kinds of call it takes, each
    ``(tuple type, fields, planner)`` (its fields by name with the dimension of a free extent, or -1), and the
    Python exception of each TVM-FFI error kind."""
    import tvm_ffi

    error_kinds = {
        name: value
        for name, value in vars(builtins).items()
        if isinstance(value, type) and issubclass(value, BaseException)
    }
    error_kinds.update(getattr(tvm_ffi.core, "ERROR_NAME_TO_TYPE", {}))  # kinds registered with TVM-FFI
    prefill_fields = tuple((name, FREE_EXTENTS.get(name, -1)) for name in PrefillCall._fields)
    return {
        "kinds": (
            (PrefillCall, prefill_fields, launch_plan),
            (PagedCall, tuple((name, -1) for name in PagedCall._fields), paged_launch_plan),
        ),
        "error_kinds": error_kinds,
    }


def launch_plan(call: PrefillCall) -> tuple:
    """The extension's answer for the key of a ``PrefillCall`` (it asks on a memo miss): a plan, or ``(reason,
    kept)``, why such calls are left to the Python path, ``kept`` when that holds for every call of the key
    (memoised, as plans are; else asked again: the contract rejected this call, or its addresses, or a variant
    is not loaded yet).

    A plan is ``(schedule, arguments, launches, outputs)``, fields by their index in the call: ``schedule``
    ``(tiles per CTA, splits, split_from)`` (``schedule.choose``); ``arguments`` the kernel's tensor
    arguments (``kernels.attention_plan``), each ``(source, dtype or None, per token, alignment in bytes,
    sizes, strides)``: ``source`` a field, or a tensor the plan holds (a constant), viewed with ``sizes``
    and ``strides`` when not None; ``launches`` ``(TVM-FFI function handle, first token, tokens,
    scalars)``; ``outputs`` ``(field, shape, dtype)``, returned, and allocated when the call gives none.
    Only calls of the common case get one: a registered device; a valid call (the contract); a Python float
    sm_scale; all output buffers or none; no empty extent; 1-D scales; the layout the launch needs without
    copies; loaded TVM-FFI variants."""
    declined = _declined(call)
    if declined:
        return declined
    try:
        problem = contract.check_inputs(call)
    except (TypeError, ValueError) as error:
        return f"the Python path raises {type(error).__name__}: {error}", False
    return _plan(call, _PREFILL_FIELDS, problem, {})


def paged_launch_plan(call: PagedCall) -> tuple:
    """``launch_plan``'s answer for a ``PagedCall`` (``sparse_mla_q8kv8_paged_fwd`` without an extra cache),
    its checks ``paged.check_paged_inputs``: the kernel's kv is the cache viewed as ``[num_pages, page_size,
    bytes per token]`` uint8 (``paged.check_cache``), its extra cache the same view of no pages, its kv_scale
    the constant 1.0 (``paged.unit_kv_scale``)."""
    declined = _declined(call)
    if declined:
        return declined
    try:
        problem, layout, view = paged.check_paged_inputs(call)
    except (TypeError, ValueError) as error:
        return f"the Python path raises {type(error).__name__}: {error}", False
    cache = _PAGED_FIELDS["cache"]
    sizes, strides = tuple(view.shape), view.stride()
    sources = {
        "kv": (cache, torch.uint8, sizes, strides),
        "extra_cache": (cache, torch.uint8, (0, *sizes[1:]), strides),  # no extra cache: no pages
        "kv_scale": paged.unit_kv_scale(call.q.device),
    }
    return _plan(call, _PAGED_FIELDS, problem, sources, layout.name, problem.topk)


def _declined(call: PrefillCall | PagedCall) -> tuple | None:
    """``(reason, True)`` for a call whose key the fast path never takes: an unregistered device, a sm_scale
    that is not a Python float."""
    if call.q.device not in _devices:
        return "the device is not registered", True
    if type(call.sm_scale) is not float:
        return "sm_scale is not a Python float", True
    return None


def _plan(call, fields: dict, problem, sources: dict, cache: str | None = None, extra_from: int = 0) -> tuple:
    """The plan of a checked call (``problem``: its verdict), or why not: ``fields`` the call's field indices
    by name; ``sources`` what stands for a kernel argument that is not the call's field of its name (a
    constant tensor, or ``(field, dtype, sizes, strides)``: a view of that field); ``cache`` and
    ``extra_from`` ``kernels.attention_plan``'s."""
    q = call.q
    s_q = problem.s_q
    given = [getattr(call, name) is not None for name in metadata.OUTPUTS]
    if any(given) and not all(given):
        return f"only some of {', '.join(metadata.OUTPUTS)} are given", True
    if s_q == 0 or problem.s_kv == 0:
        return "s_q or s_kv is 0", True
    scales = call.q_scale, getattr(call, "kv_scale", None)  # a paged call's kv_scale: the plan's constant
    if any(scale is not None and scale.dim() != 1 for scale in scales):
        return "q_scale or kv_scale is not a 1-D tensor", True
    alignments = metadata.LAUNCH_ALIGNMENT_BYTES
    if not problem.launch_ready:
        aligned = all(
            (tensor := getattr(call, name, None)) is None or tensor.data_ptr() % alignment == 0
            for name, alignment in alignments.items()
        )
        return "q, kv, out, topk_length or attn_sink needs a copy for the launch", aligned
    has_topk_length = call.topk_length is not None
    chosen = schedule.choose(
        s_q, problem.h_q, problem.topk, has_topk_length, q.device.index, num_sms=_devices[q.device]
    )
    arguments, launches = kernels.attention_plan(
        q.shape, q.dtype, call.precision, call.sm_scale, call.q_scale is not None, has_topk_length,
        call.attn_sink is not None, *chosen, cache, extra_from,
    )  # fmt: skip
    calls = []
    for planned in launches:
        variant = kernels.loaded(planned.key)
        if variant is None:
            return (
                "the kernel variant is not loaded yet (its first launch on the Python path loads it)",
                False,
            )
        if not isinstance(variant.function, _ffi_function_type):
            return "the kernel variant is not a TVM-FFI function", True
        first, stop, _ = (planned.rows or slice(None)).indices(s_q)
        calls.append((variant.function.__chandle__(), first, stop - first, planned.scalars))
    planned_arguments = []
    for name, dtype, rows in arguments:
        source = sources.get(name, fields.get(name))
        if isinstance(source, tuple):  # a view of a field
            field, view_dtype, sizes, strides = source
            planned_arguments.append((field, view_dtype, False, alignments.get(name, 1), sizes, strides))
        else:  # a field, or a constant tensor
            planned_arguments.append((source, dtype, rows, alignments.get(name, 1), None, None))
    return (
        tuple(chosen),
        tuple(planned_arguments),
        tuple(calls),
        tuple(
            (fields[name], shape, dtype)
            for name, (shape, dtype) in zip(
                metadata.OUTPUTS, metadata.output_layouts(s_q, problem.h_q, problem.d_v), strict=True
            )
        ),
    )


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
                extension.configure(**constants())
                # Release the memoised plans (kernel variants, Python objects) while the interpreter is alive.
                atexit.register(extension.reset)
                _ffi_function_type = tvm_ffi.Function
                _extension = extension
            except Exception as exc:  # no compiler, no Python.h: every call takes the Python path
                _build_failed = True
                native_build.warn_unavailable("C++ fast path", "every call takes the Python path", exc)
    return _extension


def register_device(device: torch.device, sm_count: int) -> None:
    """Let the extension's plans run on ``device``, scheduled for ``sm_count`` multiprocessors (forgets every
    plan made before)."""
    _devices[device] = sm_count
    if _extension is not None:
        _extension.configure(**constants())


def note_launch(device_index: int) -> None:
    """Called by the Python path after each launch on a CUDA device (whose capability the contract has then
    checked): the first launch on the device registers it (``schedule.sm_count``'s multiprocessors), and from
    then on ``launch`` takes the calls it can plan there. Only with one visible GPU (the extension launches on
    the current device) and never while ``suspended``."""
    if device_index in _registered_devices or _suspended or device_index < 0:
        return
    with _registration_lock:
        _register(device_index)


def _register(device_index: int) -> None:
    """``note_launch``'s registration of ``device_index`` (one thread at a time)."""
    global launch, _gpu_count
    if device_index in _registered_devices:
        return
    if _gpu_count is None:
        _gpu_count = torch.cuda.device_count()
    extension = load() if _gpu_count == 1 else None
    if extension is None:
        return
    register_device(torch.device("cuda", device_index), schedule.sm_count(device_index))
    _registered_devices.add(device_index)
    launch = extension.launch


def disable() -> None:
    """Forget every registered device and memoised plan (tests); the next launch of the Python path on a GPU
    registers again."""
    global launch, _resumed_launch
    launch = _resumed_launch = None
    _registered_devices.clear()
    _devices.clear()
    if _extension is not None:
        _extension.configure(**constants())


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
