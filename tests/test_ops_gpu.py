"""The custom ops on an H100/H200 (``gpu`` marker): ``torch.compile(fullgraph=True)`` with Inductor gives
the eager outputs bit for bit, ``torch.library.opcheck`` passes, and compiled code is captured in CUDA
graphs (by hand and by ``mode="reduce-overhead"``)."""

import math

import pytest
import torch

from q8kv8 import sparse_mla_q8kv8_prefill_fwd

pytestmark = pytest.mark.gpu

FUNCTIONAL = torch.ops.q8kv8.sparse_mla_q8kv8_prefill.default
OUT = torch.ops.q8kv8.sparse_mla_q8kv8_prefill_out.default
OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
"""opcheck's tests but ``test_schema``, whose SchemaCheckMode compares fp8 inputs with ``torch.allclose``
(not implemented for float8); ``tests/test_ops_cpu.py`` checks what the out op writes."""

TENSORS = ("q", "kv", "indices", "q_scale", "kv_scale", "attn_sink", "topk_length")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def nan_buffers_like(outputs) -> dict:
    return dict(
        zip(("out", "max_logits", "lse"), (torch.full_like(t, math.nan) for t in outputs), strict=True)
    )


def assert_equal(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def compiled_call(sm_scale, **options):
    def call(q, kv, indices, q_scale, kv_scale, attn_sink, topk_length, **buffers):
        return sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, sm_scale, q_scale, kv_scale, 512, attn_sink, topk_length, **buffers
        )

    return torch.compile(call, fullgraph=True, **options)


@pytest.mark.parametrize("h_q", [128, 48])
@pytest.mark.parametrize("with_buffers", [False, True])
def test_compiled_matches_eager(make_inputs, h_q, with_buffers):
    inputs = make_inputs(40, h_q, 5000, 576, 512, device="cuda", with_sink=True, with_topk_length=True)
    eager = sparse_mla_q8kv8_prefill_fwd(**inputs)
    buffers = nan_buffers_like(eager) if with_buffers else {}
    compiled = compiled_call(inputs["sm_scale"])(**{name: inputs[name] for name in TENSORS}, **buffers)
    torch.cuda.synchronize()
    assert_equal(compiled, eager)
    if with_buffers:
        assert all(got is given for got, given in zip(compiled, buffers.values(), strict=True))


def test_opcheck(make_inputs):
    inputs = make_inputs(12, 64, 3000, 512, 256, device="cuda", with_sink=True, with_topk_length=True)
    args = tuple(inputs[name] for name in ("q", "kv", "indices", "sm_scale", "q_scale", "kv_scale", "d_v"))
    options = (inputs["attn_sink"], inputs["topk_length"], "default")
    torch.library.opcheck(FUNCTIONAL, (*args, *options), test_utils=OPCHECK_TESTS)
    buffers = tuple(nan_buffers_like(sparse_mla_q8kv8_prefill_fwd(**inputs)).values())
    torch.library.opcheck(OUT, (*args, *options, *buffers), test_utils=OPCHECK_TESTS)


def test_compiled_call_captured_in_a_cuda_graph(make_inputs):
    inputs = make_inputs(24, 128, 3000, 576, 256, device="cuda", with_sink=True, with_topk_length=True)
    tensors = {name: inputs[name] for name in TENSORS}
    eager = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs)]
    buffers = nan_buffers_like(eager)
    compiled = compiled_call(inputs["sm_scale"])
    compiled(**tensors, **buffers)  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(**tensors, **buffers)
    for buffer in buffers.values():
        buffer.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert_equal(tuple(buffers.values()), eager)


def test_reduce_overhead_mode(make_inputs):
    """Inductor's own CUDA graphs: warm-up, recording and replays all give the eager outputs."""
    inputs = make_inputs(24, 64, 3000, 512, 256, device="cuda", with_sink=True, with_topk_length=True)
    tensors = {name: inputs[name] for name in TENSORS}
    eager = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs)]
    compiled = compiled_call(inputs["sm_scale"], mode="reduce-overhead")
    for _ in range(4):
        outputs = [t.clone() for t in compiled(**tensors)]
        torch.cuda.synchronize()
        assert_equal(outputs, eager)
