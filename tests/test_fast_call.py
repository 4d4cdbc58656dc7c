"""The C++ fast call's extension (``q8kv8.fast_call``) on a CPU-only machine: built for real against the
installed torch; its allocation compared with the Python allocation's (``ops.output_buffers``), its binding
and its fallback. Its launches are tested with the fast launch's checks (``test_fast_launch.py``)."""

import random
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from q8kv8 import fast_call, fast_launch, native_build, ops

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None, reason="needs a C++ compiler"
)


@pytest.fixture(scope="module")
def extension():
    module = fast_call.load()
    assert module is not None, "the fast call did not build (see the warning)"
    return module


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
        allocated = extension.allocate(q, 512)
        expected = ops.output_buffers(q, h, 512)
        assert [facts(t) for t in allocated] == [facts(t) for t in expected]
        pointers = {t.data_ptr() for t in allocated if t.numel()}
        assert q.data_ptr() not in pointers and len(pointers) == (3 if s_q else 0)  # three new storages


def test_follows_inference_mode_and_the_deterministic_fill(extension):
    q = torch.empty(3, 64, 576, dtype=torch.float8_e4m3fn)
    with torch.inference_mode():
        assert all(t.is_inference() for t in extension.allocate(q, 512))
    restore = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert all(t.float().isnan().all() for t in extension.allocate(q, 512))
    finally:
        torch.use_deterministic_algorithms(restore[0])
        torch.utils.deterministic.fill_uninitialized_memory = restore[1]


class TensorSubclass(torch.Tensor):
    pass


def test_anything_but_a_plain_3d_tensor_gets_no_buffers(extension):
    q = torch.empty(2, 64, 576)
    for not_plain in (q[0], q.unsqueeze(0), q.as_subclass(TensorSubclass), q.tolist(), None, 3):
        assert extension.allocate(not_plain, 512) == (None, None, None)
        assert fast_call.allocate_in_python(not_plain, 512) == (None, None, None)
    parameter = torch.nn.Parameter(q, requires_grad=False)  # torch counts a Parameter as a plain tensor
    for allocate in (extension.allocate, fast_call.allocate_in_python):
        assert [facts(t) for t in allocate(parameter, 512)] == [facts(t) for t in allocate(q, 512)]


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
        ops.output_buffers(q, 1, 512)
    with pytest.raises(Exception) as from_extension:
        extension.allocate(q, 512)
    assert type(from_extension.value) is type(from_python.value)


def test_bad_binding_and_unbound_launch(extension):
    with pytest.raises(TypeError, match="takes 2 arguments"):
        extension.bind(0)
    fake_api = torch.zeros(4, dtype=torch.int64)  # a "C interface" of version 0
    with pytest.raises(RuntimeError, match="version 0, expected 1"):
        extension.bind(fake_api.data_ptr(), None)
    with pytest.raises(TypeError, match="13 arguments"):
        extension.launch(1, 2, 3)


def test_a_failed_build_warns_and_takes_the_tvm_ffi_call(monkeypatch, tmp_path):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler (c++, g++ or $CXX) on PATH")

    monkeypatch.setattr(fast_call, "_extension", None)
    monkeypatch.setattr(fast_call, "_build_failed", False)
    monkeypatch.setattr(fast_call, "_build_dir", lambda: tmp_path)
    monkeypatch.setattr(native_build, "build_library", no_compiler)
    with pytest.warns(RuntimeWarning, match=r"C\+\+ fast call is unavailable.*no C\+\+ compiler"):
        assert fast_call.load() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fast_call.load() is None  # warned once
        assert fast_launch._per_call_launch(object()) is fast_launch.launch_through_tvm_ffi


def test_a_built_extension_loads_without_importing_the_build_tools(extension):
    """Once built, ``import q8kv8`` loads the extension without importing torch.utils.cpp_extension (and
    with it setuptools, ~90 ms)."""
    code = "import sys, q8kv8; print(sorted({'setuptools', 'torch.utils.cpp_extension'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
