"""The C++ fast path's extension (``q8kv8.native``) on a CPU-only machine, beyond its checks
(``test_native.py``): its allocation compared with the Python path's (``eager.output_buffers``), its
configuration and registration interface, and what happens when it cannot be built."""

import os
import random
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from q8kv8 import contract, eager, native, native_build, schedule, sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import D_V
from q8kv8.prefill_call import PrefillCall

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler"
)


@pytest.fixture
def extension():
    module = native.load()
    assert module is not None, "the C++ fast path did not build (see the warning)"
    yield module
    native.disable()  # configured again, nothing registered


def facts(tensor: torch.Tensor) -> tuple:
    return (
        tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.layout, tensor.requires_grad,
        tensor.is_inference(), tensor.storage_offset(), tensor.untyped_storage().nbytes(),
    )  # fmt: skip


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_allocates_what_the_python_path_allocates(extension, q_dtype):
    for _ in range(4):
        s_q, h, d_qk = random.choice([0, 1, 37]), random.choice([16, 64, 128]), random.choice([512, 576])
        q = torch.empty(s_q, h, d_qk, dtype=q_dtype)
        allocated = extension.allocate(q, D_V)
        expected = eager.output_buffers(q, h, D_V)
        assert [facts(t) for t in allocated] == [facts(t) for t in expected]
        pointers = {t.data_ptr() for t in allocated if t.numel()}
        assert q.data_ptr() not in pointers and len(pointers) == (3 if s_q else 0)  # three new storages


def test_follows_inference_mode_and_the_deterministic_fill(extension):
    q = torch.empty(3, 64, 576, dtype=torch.float8_e4m3fn)
    with torch.inference_mode():
        assert all(t.is_inference() for t in extension.allocate(q, D_V))
    restore = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert all(t.float().isnan().all() for t in extension.allocate(q, D_V))
    finally:
        torch.use_deterministic_algorithms(restore[0])
        torch.utils.deterministic.fill_uninitialized_memory = restore[1]


class TensorSubclass(torch.Tensor):
    pass


def test_anything_but_a_plain_3d_tensor_gets_no_buffers(extension):
    q = torch.empty(2, 64, 576)
    for not_plain in (q[0], q.unsqueeze(0), q.as_subclass(TensorSubclass), q.tolist(), None, 3):
        assert extension.allocate(not_plain, D_V) == (None, None, None)
    parameter = torch.nn.Parameter(q, requires_grad=False)  # torch counts a Parameter as a plain tensor
    assert [facts(t) for t in extension.allocate(parameter, D_V)] == [
        facts(t) for t in extension.allocate(q, D_V)
    ]


def test_bad_arguments_raise(extension):
    q = torch.empty(2, 64, 576)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        extension.allocate(q)
    with pytest.raises(TypeError):
        extension.allocate(q, "512")
    with pytest.raises(ValueError, match="d_v must be >= 0"):
        extension.allocate(q, -1)


def test_a_failed_allocation_raises_what_torch_raises(extension):
    q = torch.empty(2**40, 1, 0)  # no elements; its output would be 2**40 x 512 bfloat16
    with pytest.raises(Exception) as from_python:
        eager.output_buffers(q, 1, D_V)
    with pytest.raises(Exception) as from_extension:
        extension.allocate(q, D_V)
    assert type(from_extension.value) is type(from_python.value)


def test_configuration_and_registration_errors(extension):
    import tvm_ffi

    q = torch.empty(2, 64, 576)
    with pytest.raises(TypeError, match="expected a q8kv8.prefill_call.PrefillCall"):
        extension.launch((q,))
    with pytest.raises(TypeError, match="expected a q8kv8.prefill_call.PrefillCall"):
        extension.plan(None)
    function = tvm_ffi.convert(lambda: None).__chandle__()
    fp8 = torch.float8_e4m3fn
    one_tile, split = schedule.ONE_TILE, schedule.SPLIT
    with pytest.raises(ValueError, match="no variant d_qk 128"):
        extension.register_variant(128, "default", one_tile, function, fp8, 64)
    with pytest.raises(ValueError, match="no variant d_qk 576, precision 'fast'"):
        extension.register_variant(576, "fast", one_tile, function, fp8, 64)
    with pytest.raises(ValueError, match=r"precision 'default', schedule kind 0, q dtype torch.float16"):
        extension.register_variant(576, "default", one_tile, function, torch.float16, 64)
    with pytest.raises(ValueError, match="q dtype 'bf16'"):
        extension.register_variant(576, "default", split, function, "bf16", 64)
    with pytest.raises(ValueError, match="schedule kind 3,"):
        extension.register_variant(576, "default", 3, function, fp8, 64)
    with pytest.raises(
        ValueError, match="q dtype torch.float8_e4m3fn, heads 48"
    ):  # neither 64 nor small heads
        extension.register_variant(576, "default", one_tile, function, fp8, 48)
    with pytest.raises(
        ValueError, match="schedule kind 0, q dtype torch.float8_e4m3fn, heads 16"
    ):  # persistent only
        extension.register_variant(576, "default", one_tile, function, fp8, 16)
    with pytest.raises(TypeError, match="takes 6 arguments"):
        extension.register_variant(576, "default", one_tile, function, fp8)
    with pytest.raises(TypeError, match="register_variant: handle is not a TVM-FFI function"):
        extension.register_variant(576, "default", one_tile, tvm_ffi.convert([1, 2]).__chandle__(), fp8, 64)
    with pytest.raises(ValueError, match="sm_count < 1"):
        extension.register_device(1, 0, 0)
    constants = native.constants()
    with pytest.raises(KeyError, match="no constant log2_e"):
        extension.configure({name: value for name, value in constants.items() if name != "log2_e"})
    call = PrefillCall(q, q, q, 0.1, q, q)
    assert extension.plan(call) == -1 and extension.decline_reason(call) == "the fast path is not configured"
    with pytest.raises(ValueError, match="configure: the call has no field indices"):
        extension.configure({**constants, "fields": ("q", "kv")})
    with pytest.raises(ValueError, match="head_alignment must be >= 1"):
        extension.configure({**constants, "head_alignment": 0})
    with pytest.raises(TypeError, match="q_dtypes must be torch dtypes the checks read"):
        extension.configure({**constants, "q_dtypes": (torch.float8_e4m3fn, torch.float16)})
    with pytest.raises(ValueError, match="q_dtypes must not be empty"):
        extension.configure({**constants, "q_dtypes": ()})


def test_a_failed_build_warns_once_and_calls_take_the_python_path(
    monkeypatch, tmp_path, fake_kernels, make_inputs
):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")

    monkeypatch.setattr(native, "_extension", None)
    monkeypatch.setattr(native, "_build_failed", False)
    monkeypatch.setattr(native, "_build_dir", lambda: tmp_path)
    monkeypatch.setattr(native, "_gpu_count", 1)
    monkeypatch.setattr(native, "launch", None)
    monkeypatch.setattr(native_build, "build_library", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ fast path is unavailable.*no C\+\+ compiler"):
        assert native.load() is None
    launches = []
    fake_kernels(lambda *args: launches.append(args))
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    args = make_inputs(4, 64, 32, 576, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load() is None  # warned once
        native.note_launch(0, 576, "default", False, object())  # nothing to register with
        assert native.launch is None
        assert (
            native.decline_reason(PrefillCall(**args))
            == "the C++ fast path is unavailable (it did not build)"
        )
        sparse_mla_q8kv8_prefill_fwd(**args)  # the Python path
    assert len(launches) == 1


def test_a_built_extension_loads_without_importing_the_build_tools(extension):
    """Once built, ``import q8kv8`` loads the extension without importing torch.utils.cpp_extension (and
    with it setuptools)."""
    code = "import sys, q8kv8; print(sorted({'setuptools', 'torch.utils.cpp_extension'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_a_first_build_prints_only_its_own_build_lines(tmp_path):
    """``import q8kv8`` and the fast path's first build (a fresh cache) print nothing on stderr but q8kv8's
    build lines: the announcement, then one line naming the library and its seconds. torch's
    ``cpp_extension`` module, which with a CUDA build of torch and no GPU prints a warning about CUDA_HOME
    when imported, is not imported."""
    script = textwrap.dedent(
        """
        import sys
        import q8kv8
        from q8kv8 import native
        assert native.load() is not None
        print(sorted({"setuptools", "torch.utils.cpp_extension"} & set(sys.modules)))
        """
    )
    environment = {**os.environ, "Q8KV8_CACHE_DIR": str(tmp_path), "Q8KV8_COMPILE_AT_IMPORT": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip() == "[]"
    announcement, built = result.stderr.splitlines()
    assert announcement.startswith("q8kv8: building ") and f" into {tmp_path} (" in announcement
    assert re.fullmatch(rf"q8kv8: built {native.MODULE_NAME} \(\d+\.\d s\)", built), built
