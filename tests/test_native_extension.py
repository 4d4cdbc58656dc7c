"""The C++ fast path's extension (``q8kv8.native``) on a CPU-only machine, beyond its plans
(``test_native.py``): its allocation of a plan's outputs compared with the Python path's
(``eager.output_buffers``), its configuration and planner interface, and what happens when it cannot be
built."""

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
from native_stub import allocate, with_planner

from q8kv8 import contract, eager, native, native_build, sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import D_V, output_layouts
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


def layouts(q: torch.Tensor) -> tuple:
    """The (shape, dtype) of a call's outputs for ``q`` (what a plan hands the extension to allocate)."""
    return output_layouts(q.shape[0], q.shape[1], D_V)


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
        allocated = allocate(extension, q, layouts(q))
        expected = eager.output_buffers(q, h, D_V)
        assert [facts(t) for t in allocated] == [facts(t) for t in expected]
        pointers = {t.data_ptr() for t in allocated if t.numel()}
        assert q.data_ptr() not in pointers and len(pointers) == (3 if s_q else 0)  # three new storages


def test_follows_inference_mode_and_the_deterministic_fill(extension):
    q = torch.empty(3, 64, 576, dtype=torch.float8_e4m3fn)
    with torch.inference_mode():
        assert all(t.is_inference() for t in allocate(extension, q, layouts(q)))
    restore = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    try:
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        assert all(t.float().isnan().all() for t in allocate(extension, q, layouts(q)))
    finally:
        torch.use_deterministic_algorithms(restore[0])
        torch.utils.deterministic.fill_uninitialized_memory = restore[1]


class TensorSubclass(torch.Tensor):
    pass


def test_anything_but_a_plain_tensor_gets_no_buffers(extension):
    q = torch.empty(2, 64, 576)
    for not_plain in (q.as_subclass(TensorSubclass), torch._neg_view(q), q.tolist()):
        assert allocate(extension, not_plain, layouts(q)) is None  # declined
    parameter = torch.nn.Parameter(q, requires_grad=False)  # torch counts a Parameter as a plain tensor
    assert [facts(t) for t in allocate(extension, parameter, layouts(q))] == [
        facts(t) for t in allocate(extension, q, layouts(q))
    ]


def test_a_failed_allocation_raises_what_torch_raises(extension):
    q = torch.empty(2**40, 1, 0)  # no elements; its output would be 2**40 x 512 bfloat16
    with pytest.raises(Exception) as from_python:
        eager.output_buffers(q, 1, D_V)
    with pytest.raises(Exception) as from_extension:
        allocate(extension, q, layouts(q))
    assert type(from_extension.value) is type(from_python.value)


def test_configuration_and_planner_errors(extension):
    import tvm_ffi

    q = torch.empty(2, 64, 576)
    with pytest.raises(TypeError, match="expected a q8kv8.prefill_call.PrefillCall"):
        extension.launch((q,))
    with pytest.raises(TypeError, match="expected a q8kv8.prefill_call.PrefillCall"):
        extension.plan(None)
    constants = native.constants()
    call = PrefillCall(q, q, q, 0.1, q, q)
    # The planner's plan is checked: a malformed one raises (a bug of the planner), and is not memoised.
    handle = tvm_ffi.convert(lambda *args: None).__chandle__()
    launches = ((handle, 0, 2, ()),)
    argument = (0, None, True, 16, None, None)
    for malformed in (
        (),
        "declined",
        ((0, 1, 0), (), launches, ()),  # no tensor argument
        ((0, 1, 0), (argument,), ((0, 0, 2, ()),), ()),  # not a TVM-FFI function
        ((0, 1, 0), ((3, None, True, 16, None, None),), launches, ()),  # sm_scale is no tensor
        ((0, 1, 0), ((0, None, True, 16),), launches, ()),  # no view
        ((0, 1, 0), (argument, (0, None, False, 16, (2, 3), (3,))), launches, ()),  # sizes and strides differ
        ((0, 1, 0), (argument, (0, None, True, 16, (2, 3), (3, 1))), launches, ()),  # a view per token
        ((0, 1, 0), ((q, None, False, 16, None, None),), launches, ()),  # a constant first
        ((0, 1, 0), (argument, (q, None, True, 16, None, None)), launches, ()),  # a constant per token
        ((0, 1, 0), (argument, ("q", None, False, 16, None, None)), launches, ()),  # neither field nor tensor
        ((0, 1, 0), (argument,), launches, ((9, (2, -1), torch.float32),)),  # a negative size
        ((0, 1, 0), (argument,), launches, ((3, (2, 1), torch.float32),)),  # nor an output
    ):
        extension.configure(**with_planner(lambda call, plan=malformed: plan))
        with pytest.raises(TypeError, match="the planner's plan is malformed"):
            extension.launch(call)
    extension.configure(**with_planner(lambda call: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        extension.plan(call)  # the planner's own error
    answers = []
    for kept in (False, True):  # a decline the planner keeps is memoised, another one asked again
        extension.configure(**with_planner(lambda call, kept=kept: answers.append(call) or ("no", kept)))
        for _ in range(2):
            assert extension.plan(call) == -1 and extension.decline_reason(call) == "no"
            assert extension.launch(call) is None
    assert len(answers) == 6 + 1
    with pytest.raises(TypeError, match="missing required argument 'kinds'"):
        extension.configure(error_kinds=constants["error_kinds"])
    assert extension.plan(call) == -1 and extension.decline_reason(call) == "the fast path is not configured"
    for fields in ((("q", 8),), (("q",),), ("q",)):  # a dimension past the last one read, none, no pair
        with pytest.raises(ValueError, match=r"configure: expected \(tuple type, \(name, dim or -1\) pairs"):
            extension.configure(**with_planner(lambda call: None, fields))
    assert extension.plan(call) == -1  # a failed configuration leaves none
    with pytest.raises(ValueError, match="pairs, planner"):
        extension.configure(**with_planner(None))
    with pytest.raises(ValueError, match="pairs, planner"):  # not a tuple type
        extension.configure(**{**constants, "kinds": ((int, (), lambda call: None),)})
    with pytest.raises(TypeError):
        extension.configure(**{**constants, "error_kinds": ()})


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
        native.note_launch(0)  # nothing to register with
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
