"""The bf16 attention kernel (``q8kv8.kernels.launch_sparse_prefill_bf16``) against the float64
reference, on an H100/H200 (``gpu`` marker; skipped elsewhere).

Tolerances: P is rounded to bf16 before the PV product and out to bf16, so
``||out - ref|| / ||ref|| <= 1e-2``; max_logits and lse come from bf16 products accumulated in f32
and must agree to 1e-2 relative (absolute below 1). Rows with no valid slot must hold the sentinels
exactly (out 0, max_logits -inf, lse +inf).
"""

import math

import pytest
import torch
from cuda_graphs import assert_replays_match_eager
from reference_checks import assert_outputs_match, grid_s_kv, reference_grid, with_every_invalid_index_kind

from q8kv8 import kernels, serving
from q8kv8.reference import sparse_mla_prefill_reference

pytestmark = pytest.mark.gpu

OUT_TOLERANCE = 1e-2
STAT_TOLERANCE = 1e-2
BF16 = torch.bfloat16


def make_inputs(
    generator, s_q, h, s_kv, d_qk, topk, *, invalid_fraction=0.25, sink=False, topk_length=False, q_std=1.0
):
    indices = torch.randint(0, max(s_kv, 1), (s_q, 1, topk), generator=generator, dtype=torch.int32)
    dropped = torch.rand(indices.shape, generator=generator) < invalid_fraction
    inputs = {
        "q": (torch.randn(s_q, h, d_qk, generator=generator) * q_std).to(BF16).cuda(),
        "kv": torch.randn(s_kv, 1, d_qk, generator=generator).to(BF16).cuda(),
        "indices": indices.masked_fill(dropped, -1).cuda(),
        "sm_scale": d_qk**-0.5,
        "attn_sink": torch.randn(h, generator=generator).cuda() if sink else None,
        "topk_length": (
            torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32).cuda()
            if topk_length
            else None
        ),
    }
    return inputs


def launch(inputs, out, max_logits, lse):
    """Queue the kernel on the current stream (no sync: usable under graph capture)."""
    kernels.launch_sparse_prefill_bf16(
        inputs["q"],
        inputs["kv"],
        inputs["indices"],
        inputs["topk_length"],
        inputs["attn_sink"],
        float(inputs["sm_scale"]),
        out,
        max_logits,
        lse,
    )


def run_kernel(inputs, out=None, max_logits=None, lse=None):
    s_q, h, _ = inputs["q"].shape
    device = inputs["q"].device
    if out is None:
        out = torch.empty(s_q, h, 512, dtype=BF16, device=device)
        max_logits = torch.empty(s_q, h, dtype=torch.float32, device=device)
        lse = torch.empty(s_q, h, dtype=torch.float32, device=device)
    launch(inputs, out, max_logits, lse)
    torch.cuda.synchronize()
    return out, max_logits, lse


def reference(inputs):
    return sparse_mla_prefill_reference(
        inputs["q"],
        inputs["kv"],
        inputs["indices"],
        inputs["sm_scale"],
        1.0,
        1.0,
        512,
        inputs["attn_sink"],
        inputs["topk_length"],
        chunk_rows=32,
    )


def assert_matches_reference(outputs, inputs, out_tolerance=OUT_TOLERANCE):
    return assert_outputs_match(outputs, reference(inputs), out_tolerance, STAT_TOLERANCE)


@reference_grid
def test_matches_reference(generator, d_qk, h_q, topk, s_kv_kind, extras):
    s_kv = grid_s_kv(topk, s_kv_kind)
    with_extras = extras == "sink_and_topk_length"
    inputs = make_inputs(generator, 37, h_q, s_kv, d_qk, topk, sink=with_extras, topk_length=with_extras)
    assert_matches_reference(run_kernel(inputs), inputs)


@pytest.mark.parametrize("d_qk", [512, 576])
def test_large_logits_move_the_lazy_max(generator, d_qk):
    """Logits with a std of ~8 (q scaled): the running max passes the lazy threshold on many pairs,
    so the synchronous redo and the O rescale run often."""
    inputs = make_inputs(generator, 24, 128, 8192, d_qk, 2048, q_std=8.0, sink=True, invalid_fraction=0.1)
    assert_matches_reference(run_kernel(inputs), inputs)


@pytest.mark.parametrize("d_qk", [512, 576])
def test_increasing_logits_rescale_every_pair(generator, d_qk):
    """Logits that grow along the slots: every pair's max passes the running max."""
    inputs = make_inputs(generator, 8, 64, 2048, d_qk, 1024, invalid_fraction=0.0)
    q = inputs["q"].float()
    q[:] = q[0:1, 0:1]  # every row the same query
    kv = inputs["kv"].float()
    direction = q[0, 0] / q[0, 0].norm()
    kv = kv - (kv[:, 0] @ direction)[:, None, None] * direction  # orthogonal to q
    kv = (
        kv
        + torch.linspace(-30, 30, 2048, device="cuda")[:, None, None] * direction * d_qk**0.5 / q[0, 0].norm()
    )
    inputs["q"], inputs["kv"] = q.to(BF16), kv.to(BF16)
    inputs["indices"] = torch.arange(1024, dtype=torch.int32, device="cuda").repeat(8, 1, 1) * 2
    assert_matches_reference(run_kernel(inputs), inputs)


def test_every_invalid_index_kind_and_duplicates(generator):
    inputs = make_inputs(generator, 16, 64, 3000, 576, 256, invalid_fraction=0.0)
    inputs["indices"] = with_every_invalid_index_kind(inputs["indices"], 3000, generator)
    assert_matches_reference(run_kernel(inputs), inputs)


def test_sink_infinities_and_empty_rows(generator):
    inputs = make_inputs(generator, 12, 128, 500, 512, 128, sink=True)
    sink = inputs["attn_sink"]
    sink[0::3] = math.inf
    sink[1::3] = -math.inf
    inputs["indices"][2:5] = -1
    out, max_logits, lse = run_kernel(inputs)
    assert_matches_reference((out, max_logits, lse), inputs)
    assert (out[:, 0::3] == 0).all(), "sink +inf must zero out"
    assert (out[2:5] == 0).all() and (lse[2:5] == math.inf).all() and (max_logits[2:5] == -math.inf).all()


@pytest.mark.parametrize("d_qk", [512, 576])
def test_topk_length_edges_clamped(generator, d_qk):
    inputs = make_inputs(generator, 10, 64, 4000, d_qk, 512, topk_length=True)
    inputs["topk_length"] = torch.tensor(
        [0, 1, 31, 32, 33, 64, 65, 511, 900, -7], dtype=torch.int32, device="cuda"
    )
    out, max_logits, lse = run_kernel(inputs)
    assert_matches_reference((out, max_logits, lse), inputs)
    for row in (0, 9):
        assert (out[row] == 0).all() and (lse[row] == math.inf).all() and (max_logits[row] == -math.inf).all()


def test_strided_kv_and_indices(generator):
    """kv rows with a padded row stride (multiple of 8 elements) and indices sliced from a wider
    buffer: both are read through their strides."""
    inputs = make_inputs(generator, 9, 64, 3000, 576, 256, sink=True, topk_length=True)
    wide_kv = torch.zeros(3000, 1, 640, dtype=BF16, device="cuda")
    wide_kv[:, :, :576] = inputs["kv"]
    wide_idx = torch.full((9, 1, 384), 5, dtype=torch.int32, device="cuda")
    wide_idx[:, :, :256] = inputs["indices"]
    strided = dict(inputs, kv=wide_kv[:, :, :576], indices=wide_idx[:, :, :256])
    assert_matches_reference(run_kernel(strided), inputs)


def test_poisoned_outputs_fully_written(generator):
    inputs = make_inputs(generator, 33, 128, 5000, 512, 256, sink=True, topk_length=True)
    out = torch.full((33, 128, 512), math.nan, dtype=BF16, device="cuda")
    max_logits = torch.full((33, 128), math.nan, device="cuda")
    lse = torch.full((33, 128), math.nan, device="cuda")
    assert_matches_reference(run_kernel(inputs, out, max_logits, lse), inputs)


def test_serving_hook_pads_heads(generator):
    """Through ``serving._cuda_attention_bf16`` (what ``SparsePrefill("bf16")`` calls), heads padded
    to 64 with a -inf sink like the serving path does."""
    inputs = make_inputs(generator, 11, 64, 1500, 576, 256, sink=True, topk_length=True)
    inputs["q"][:, 20:] = 0
    inputs["attn_sink"][20:] = -math.inf
    out, max_logits, lse = serving._cuda_attention_bf16(
        inputs["q"],
        inputs["kv"],
        inputs["indices"],
        inputs["sm_scale"],
        inputs["attn_sink"],
        inputs["topk_length"],
    )
    torch.cuda.synchronize()
    assert_matches_reference((out, max_logits, lse), inputs)


def test_cuda_graph_replay(generator):
    inputs = make_inputs(generator, 24, 128, 3000, 576, 512, sink=True, topk_length=True)
    assert_replays_match_eager(
        lambda **buffers: run_kernel(inputs, **buffers),
        lambda **buffers: launch(inputs, **buffers),
        replays=3,
    )


def test_runs_on_callers_stream(generator):
    inputs = make_inputs(generator, 16, 64, 2000, 512, 256, topk_length=True)
    q_later = torch.randn(16, 64, 512, generator=generator).to(BF16).cuda()
    expected = run_kernel(dict(inputs, q=q_later))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out = torch.empty_like(expected[0])
    max_logits, lse = torch.empty_like(expected[1]), torch.empty_like(expected[2])
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        inputs["q"].copy_(q_later)
        launch(inputs, out, max_logits, lse)  # no attn_sink in these inputs
    torch.cuda.synchronize()
    for a, b in zip(expected, (out, max_logits, lse), strict=True):
        assert torch.equal(a, b)
