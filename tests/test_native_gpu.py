"""The C++ fast path (``q8kv8.native``) on an H100/H200 (``gpu`` marker): after a first launch the public
call takes it, and it gives the Python path's results bit for bit, on the caller's stream and inside a CUDA
graph capture; for an e4m3 q and for a bfloat16 q (whose kernel variants it registers separately)."""

import math

import pytest
import torch
from cuda_graphs import capture_and_replay
from native_stub import allocate

from q8kv8 import eager, native, sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import output_layouts

pytestmark = pytest.mark.gpu
Q_DTYPES = pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])


@pytest.fixture
def python_path_tripwire(monkeypatch):
    """Make the Python path (the contract) fail the test: whatever runs next must take the fast path."""

    def check_inputs(call):
        raise AssertionError(f"the call took the Python path: {native.decline_reason(call)}")

    def arm():
        monkeypatch.setattr(eager, "check_inputs", check_inputs)

    return arm


def nan_like(outputs):
    return [torch.full_like(t, math.nan) for t in outputs]


@Q_DTYPES
@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize(
    ("s_q", "h_q", "d_qk", "topk", "with_extras"),
    # (1100, 64, ...): the persistent schedule (k = 2); (20, 64, ...): the split one (4 parts);
    # (9, 48, ...): split in 2, partly filled head tiles; (300, 16, ...), (5, 8, ...): the small-head kernel
    # (3 and 1 tokens per CTA)
    [
        (37, 128, 576, 512, False),
        (1100, 64, 512, 256, True),
        (20, 64, 576, 2048, True),
        (9, 48, 576, 512, True),
        (300, 16, 576, 2048, True),
        (5, 8, 512, 256, False),
    ],
)
def test_fast_path_matches_the_python_path_bitwise(
    make_inputs, python_path_tripwire, precision, s_q, h_q, d_qk, topk, with_extras, q_dtype
):
    inputs = make_inputs(
        s_q,
        h_q,
        3000,
        d_qk,
        topk,
        device="cuda",
        with_sink=with_extras,
        with_topk_length=with_extras,
        q_dtype=q_dtype,
    )
    native.disable()  # the first call takes the Python path and registers device and variant again
    python_path = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)]
    assert native.launch is native.load().launch
    python_path_tripwire()
    buffers = nan_like(python_path)
    fast = sparse_mla_q8kv8_prefill_fwd(
        **inputs, precision=precision, out=buffers[0], max_logits=buffers[1], lse=buffers[2]
    )
    allocated = sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
    torch.cuda.synchronize()
    assert all(a is b for a, b in zip(fast, buffers, strict=True))
    for outputs in (fast, allocated):
        assert all(torch.equal(a, b) for a, b in zip(outputs, python_path, strict=True))


@Q_DTYPES
def test_fast_path_runs_on_the_current_stream_and_in_a_cuda_graph(make_inputs, python_path_tripwire, q_dtype):
    inputs = make_inputs(
        24, 128, 3000, 576, 256, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    expected = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs)]
    python_path_tripwire()
    buffers = nan_like(expected)
    kwargs = dict(out=buffers[0], max_logits=buffers[1], lse=buffers[2])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs)
    stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True))
    capture_and_replay(lambda: sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs), buffers)
    assert all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True))


@Q_DTYPES
def test_allocating_calls_allocate_in_cpp_on_the_current_stream_and_in_a_cuda_graph(
    make_inputs, python_path_tripwire, q_dtype
):
    """After a first launch the fast path's allocating calls get their outputs from the C++ extension: on a
    side stream (the caching allocator's pool of that stream) and inside a CUDA graph capture (the graph's
    pool), with the Python path's results."""
    inputs = make_inputs(
        40, 64, 3000, 576, 256, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    expected = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs)]
    assert native.launch is native.load().launch  # built, and taken by the fast path
    python_path_tripwire()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        on_stream = sparse_mla_q8kv8_prefill_fwd(**inputs)
    stream.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(on_stream, expected, strict=True))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sparse_mla_q8kv8_prefill_fwd(**inputs)
    for output in captured:
        output.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, expected, strict=True))


def facts(tensor: torch.Tensor) -> tuple:
    return (
        tensor.shape, tensor.stride(), tensor.dtype, tensor.device, tensor.layout, tensor.requires_grad,
        tensor.is_inference(), tensor.storage_offset(), tensor.untyped_storage().nbytes(),
    )  # fmt: skip


def test_cuda_allocations_are_torch_caching_allocator_tensors(make_inputs, python_path_tripwire):
    """The extension's CUDA outputs (``at::detail::empty_generic`` on the allocator ``at::empty`` used) are
    what ``Tensor.new_empty`` makes: blocks of torch's caching allocator (so ``record_stream`` and the memory
    statistics apply), freed when dropped."""
    extension = native.load()
    q = torch.empty(3, 64, 576, dtype=torch.float8_e4m3fn, device="cuda")
    layouts = output_layouts(3, 64, 512)
    for _ in range(2):  # the first learns the allocator through at::empty, the second uses it directly
        expected = [facts(t) for t in eager.output_buffers(q, 64, 512)]
        assert [facts(t) for t in allocate(extension, q, layouts)] == expected
    with torch.inference_mode():
        assert all(t.is_inference() for t in allocate(extension, q, layouts))
    native.disable()  # configured again
    inputs = make_inputs(40, 64, 3000, 576, 256, device="cuda")
    sparse_mla_q8kv8_prefill_fwd(**inputs)  # registers the device and variant
    python_path_tripwire()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    outputs = sparse_mla_q8kv8_prefill_fwd(**inputs)
    assert torch.cuda.memory_allocated() - before >= sum(t.numel() * t.element_size() for t in outputs)
    active_blocks = set()
    for segment in torch.cuda.memory_snapshot():
        address = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                active_blocks.add(address)
            address += block["size"]
    assert all(t.data_ptr() in active_blocks for t in outputs)
    del outputs
    assert torch.cuda.memory_allocated() == before
    side = torch.cuda.Stream()
    for output in sparse_mla_q8kv8_prefill_fwd(**inputs):
        output.record_stream(side)
    torch.cuda.synchronize()
