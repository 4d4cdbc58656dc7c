"""The custom ops on an H100/H200 (``gpu`` marker): ``torch.compile(fullgraph=True)`` with Inductor gives
the eager outputs bit for bit, ``torch.library.opcheck`` passes, and compiled code is captured in CUDA
graphs (by hand and by ``mode="reduce-overhead"``); for an e4m3 q with its q_scale and for a bfloat16 q with
``q_scale=None``."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from cuda_graphs import capture_and_replay

from q8kv8 import sparse_mla_q8kv8_prefill_fwd

pytestmark = pytest.mark.gpu

FUNCTIONAL = torch.ops.q8kv8.sparse_mla_q8kv8_prefill.default
OUT = torch.ops.q8kv8.sparse_mla_q8kv8_prefill_out.default
OPCHECK_TESTS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
"""opcheck's tests but ``test_schema``, whose SchemaCheckMode compares fp8 inputs with ``torch.allclose``
(not implemented for float8); ``tests/test_ops_cpu.py`` checks what the out op writes."""

TENSORS = ("q", "kv", "indices", "q_scale", "kv_scale", "attn_sink", "topk_length")
Q_DTYPES = pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])


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


def gpu_inputs(
    make_inputs, q_dtype, s_q, h_q, s_kv, d_qk, topk, with_sink=True, with_topk_length=True
) -> dict:
    """``make_inputs``' call of these sizes on the GPU with a q of ``q_dtype`` (and by default a sink and
    topk_length)."""
    return make_inputs(
        s_q,
        h_q,
        s_kv,
        d_qk,
        topk,
        device="cuda",
        with_sink=with_sink,
        with_topk_length=with_topk_length,
        q_dtype=q_dtype,
    )


def compiled_arguments(inputs: dict) -> dict:
    """The tensors of ``inputs`` that ``compiled_call``'s function takes (``TENSORS``), by name."""
    return {name: inputs[name] for name in TENSORS}


def compiled_call(sm_scale, **options):
    def call(q, kv, indices, q_scale, kv_scale, attn_sink, topk_length, **buffers):
        return sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, sm_scale, q_scale, kv_scale, 512, attn_sink, topk_length, **buffers
        )

    return torch.compile(call, fullgraph=True, **options)


@Q_DTYPES
@pytest.mark.parametrize("h_q", [128, 48])
@pytest.mark.parametrize("with_buffers", [False, True])
def test_compiled_matches_eager(make_inputs, h_q, with_buffers, q_dtype):
    inputs = gpu_inputs(make_inputs, q_dtype, 40, h_q, 5000, 576, 512)
    eager = sparse_mla_q8kv8_prefill_fwd(**inputs)
    buffers = nan_buffers_like(eager) if with_buffers else {}
    compiled = compiled_call(inputs["sm_scale"])(**compiled_arguments(inputs), **buffers)
    torch.cuda.synchronize()
    assert_equal(compiled, eager)
    if with_buffers:
        assert all(got is given for got, given in zip(compiled, buffers.values(), strict=True))


@Q_DTYPES
def test_opcheck(make_inputs, q_dtype):
    inputs = gpu_inputs(make_inputs, q_dtype, 12, 64, 3000, 512, 256)
    args = tuple(inputs[name] for name in ("q", "kv", "indices", "sm_scale", "q_scale", "kv_scale", "d_v"))
    options = (inputs["attn_sink"], inputs["topk_length"], "default")
    torch.library.opcheck(FUNCTIONAL, (*args, *options), test_utils=OPCHECK_TESTS)
    buffers = tuple(nan_buffers_like(sparse_mla_q8kv8_prefill_fwd(**inputs)).values())
    torch.library.opcheck(OUT, (*args, *options, *buffers), test_utils=OPCHECK_TESTS)


@Q_DTYPES
def test_compiled_call_captured_in_a_cuda_graph(make_inputs, q_dtype):
    inputs = gpu_inputs(make_inputs, q_dtype, 24, 128, 3000, 576, 256)
    tensors = compiled_arguments(inputs)
    eager = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs)]
    buffers = nan_buffers_like(eager)
    compiled = compiled_call(inputs["sm_scale"])
    compiled(**tensors, **buffers)  # compiles and warms up outside the capture
    capture_and_replay(lambda: compiled(**tensors, **buffers), buffers.values())
    assert_equal(tuple(buffers.values()), eager)


@Q_DTYPES
def test_reduce_overhead_mode(make_inputs, q_dtype):
    """Inductor's own CUDA graphs: warm-up, recording and replays all give the eager outputs."""
    inputs = gpu_inputs(make_inputs, q_dtype, 24, 64, 3000, 512, 256)
    tensors = compiled_arguments(inputs)
    eager = [t.clone() for t in sparse_mla_q8kv8_prefill_fwd(**inputs)]
    compiled = compiled_call(inputs["sm_scale"], mode="reduce-overhead")
    for _ in range(4):
        outputs = [t.clone() for t in compiled(**tensors)]
        torch.cuda.synchronize()
        assert_equal(outputs, eager)


def reduce_overhead_call(sm_scale, precision, with_buffers):
    """A compiled function as users write it: the call plus some work on its outputs."""

    def call(q, kv, indices, q_scale, kv_scale, attn_sink, topk_length):
        buffers = {}
        if with_buffers:
            s_q, h_q, _ = q.shape
            buffers = {
                "out": q.new_empty((s_q, h_q, 512), dtype=torch.bfloat16),
                "max_logits": q.new_empty((s_q, h_q), dtype=torch.float32),
                "lse": q.new_empty((s_q, h_q), dtype=torch.float32),
            }
        out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, sm_scale, q_scale, kv_scale, 512, attn_sink, topk_length,
            precision=precision, **buffers,
        )  # fmt: skip
        return out.float() * 2, max_logits + 1, lse

    return torch.compile(call, mode="reduce-overhead", fullgraph=True)


@Q_DTYPES
@pytest.mark.parametrize(
    "with_buffers, with_sink, with_topk_length, h_q, precision",
    [
        (False, True, True, 64, "default"),
        (False, False, False, 48, "accurate"),
        (True, True, True, 48, "default"),
        (True, False, False, 64, "accurate"),
        (False, True, False, 128, "accurate"),
        (True, False, True, 64, "default"),
    ],
)
def test_reduce_overhead_functional_and_out_ops(
    make_inputs, randn_fp8, with_buffers, with_sink, with_topk_length, h_q, precision, q_dtype
):
    """cudagraph trees (warm-up, recording, replays) give the eager results bit for bit, for the
    functional op and the out op (buffers allocated inside the compiled function), with and without
    sink / topk_length, with head padding (48) and without, both precisions; also after the inputs'
    values change in place (the graph reads the new values)."""
    inputs = gpu_inputs(
        make_inputs, q_dtype, 24, h_q, 3000, 576, 256, with_sink=with_sink, with_topk_length=with_topk_length
    )
    tensors = compiled_arguments(inputs)
    compiled = reduce_overhead_call(inputs["sm_scale"], precision, with_buffers)

    def eager():
        out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
        return out.float() * 2, max_logits + 1, lse

    for step in range(5):
        if step == 3:  # new values in the same tensors
            tensors["q"].copy_(randn_fp8(*tensors["q"].shape, device="cuda"))  # e4m3 values, either dtype
            tensors["kv"].copy_(randn_fp8(*tensors["kv"].shape, device="cuda"))
            tensors["indices"].copy_(tensors["indices"].flip(-1))
            if with_topk_length:
                tensors["topk_length"].copy_(tensors["topk_length"].flip(0))
        got = [t.clone() for t in compiled(**tensors)]
        torch.cuda.synchronize()
        assert_equal(got, eager())


@pytest.mark.parametrize("q_dtype", ["float8_e4m3fn", "bfloat16"])
def test_reduce_overhead_as_the_first_call_of_a_process(q_dtype):
    """A fresh process whose first q8kv8 call is inside ``mode="reduce-overhead"`` (nothing made lazily
    by an earlier eager call; for a bfloat16 q not even its kernel variant): no allocation of the call's
    own stays in the cudagraph pool."""
    script = textwrap.dedent(
        """
        import sys, torch, q8kv8
        torch.manual_seed(0)
        q = torch.randn(128, 64, 576, device="cuda").to(getattr(torch, sys.argv[1]))
        kv = torch.randn(4096, 1, 576, device="cuda").to(torch.float8_e4m3fn)
        idx = torch.randint(0, 4096, (128, 1, 512), device="cuda", dtype=torch.int32)
        tl = torch.randint(0, 513, (128,), device="cuda", dtype=torch.int32)
        sink = torch.randn(64, device="cuda")
        one = torch.ones(1, device="cuda")
        q_scale = None if q.dtype == torch.bfloat16 else one

        def f(q, kv, idx, tl, sink):
            out, mx, lse = q8kv8.sparse_mla_q8kv8_prefill_fwd(
                q, kv, idx, 0.05, q_scale, one, 512, attn_sink=sink, topk_length=tl)
            return out.float() * 2, lse

        def g(q, kv, idx):
            out, mx, lse = q8kv8.sparse_mla_q8kv8_prefill_fwd(q[:, :48], kv, idx, 0.05, q_scale, one)
            return out.float() * 2, lse

        cf = torch.compile(f, mode="reduce-overhead", fullgraph=True)
        cg = torch.compile(g, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):
            got_f = [t.clone() for t in cf(q, kv, idx, tl, sink)]
            got_g = [t.clone() for t in cg(q, kv, idx)]
        want_f = f(q, kv, idx, tl, sink)
        want_g = g(q, kv, idx)
        assert all(torch.equal(a, b) for a, b in zip(got_f + got_g, [*want_f, *want_g]))
        print("OK")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, q_dtype],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-4000:]
