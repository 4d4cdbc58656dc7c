"""The small-head kernel (8, 16 or 32 heads, e4m3 or bf16 q: S^T = K . Q^T, the heads on the WGMMA's N
side, no padding to 64 heads; persistent) on an H100/H200 (``gpu`` marker): against the float64 reference
with the one-tile kernel's tolerances (``test_kernel_gpu``), both precisions and head dims, the sink,
``topk_length``, every kind of invalid index, the no-valid-slot sentinels exact, zero and negative scales,
the same bits on every run and for every count of tokens per CTA, and CUDA graphs."""

import math

import pytest
import torch
from cuda_graphs import capture_and_replay
from reference_checks import assert_matches_float64_reference, run_and_sync, with_every_invalid_index_kind

from q8kv8 import eager, kernels, schedule, sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import LOGITS_IN_FLOAT32

pytestmark = pytest.mark.gpu

HEADS = pytest.mark.parametrize("h_q", [8, 16, 32])
Q_DTYPES = pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])


@Q_DTYPES
@HEADS
@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize(("d_qk", "topk"), [(576, 2048), (512, 512)])
def test_matches_reference_and_is_stable(make_inputs, h_q, precision, d_qk, topk, q_dtype):
    """Sink, topk_length and invalid indices; the small-head variant ran; the second run gives the same
    bits."""
    inputs = make_inputs(
        37, h_q, 70000, d_qk, topk, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    assert schedule.describe(37, h_q, topk) == "small heads, 1 token per CTA"
    first = [t.clone() for t in run_and_sync(inputs, precision=precision)]
    summed = LOGITS_IN_FLOAT32[precision]  # the call has a sink: S summed in float32
    assert kernels.VariantKey(d_qk, summed, schedule.PERSISTENT, q_dtype, h_q) in kernels._variants
    second = run_and_sync(inputs, precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert_matches_float64_reference(first, inputs, precision)


@Q_DTYPES
@HEADS
@pytest.mark.parametrize("precision", ["default", "accurate"])
def test_tokens_per_cta_give_the_same_bits(make_inputs, h_q, precision, q_dtype):
    """A CTA walking 1, 2, 3 or 8 tokens (tokens without a valid slot, and odd and even block counts, among
    those one CTA walks) gives the bits of one token per CTA, which match the float64 reference."""
    inputs = make_inputs(
        45, h_q, 5000, 576, 1024, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    inputs["topk_length"][3:12] = torch.tensor([0, 1, 64, 65, 128, 0, 0, 200, 1024], dtype=torch.int32)
    inputs["indices"][20] = -1
    results = {}
    for tiles in (1, 2, 3, 8):
        with eager.forced_tiles_per_cta(tiles):
            results[tiles] = [t.clone() for t in run_and_sync(inputs, precision=precision)]
    assert_matches_float64_reference(results[1], inputs, precision)
    for tiles in (2, 3, 8):
        assert all(torch.equal(a, b) for a, b in zip(results[tiles], results[1], strict=True)), tiles


@HEADS
def test_every_invalid_index_kind_and_sentinels(make_inputs, generator, h_q):
    """Every kind of invalid index, duplicates, rows without a valid slot (all indices invalid, topk_length
    0), topk_length 1, and a sink of +inf (out 0) or -inf (no term) on alternate heads."""
    topk = 512
    inputs = make_inputs(10, h_q, 3000, 576, topk, device="cuda", with_sink=True, with_topk_length=True)
    inputs["indices"] = with_every_invalid_index_kind(inputs["indices"], 3000, generator)
    inputs["indices"][4] = -1
    inputs["topk_length"][:] = topk
    inputs["topk_length"][5:7] = torch.tensor([0, 1], dtype=torch.int32)
    inputs["attn_sink"][0::4] = math.inf
    inputs["attn_sink"][1::4] = -math.inf
    out, max_logits, lse = run_and_sync(inputs)
    assert_matches_float64_reference((out, max_logits, lse), inputs)
    empty = [4, 5]
    assert (
        (out[empty] == 0).all() and (lse[empty] == math.inf).all() and (max_logits[empty] == -math.inf).all()
    )
    assert (out[:, 0::4] == 0).all(), "sink +inf must zero out"


@Q_DTYPES
@HEADS
@pytest.mark.parametrize("precision", ["default", "accurate"])
def test_a_few_tokens_run_split_tiles_of_64_heads(make_inputs, h_q, precision, q_dtype):
    """A decode step of a small batch (8 tokens, topk 2048): split tiles of 64 heads (8 parts), which match
    the reference and give the bits of that forced schedule."""
    inputs = make_inputs(
        8, h_q, 70000, 576, 2048, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    assert schedule.describe(8, h_q, 2048) == "split in 8"
    chosen = [t.clone() for t in run_and_sync(inputs, precision=precision)]
    summed = LOGITS_IN_FLOAT32[precision]  # the call has a sink: S summed in float32
    assert kernels.VariantKey(576, summed, schedule.SPLIT, q_dtype) in kernels._variants
    assert_matches_float64_reference(chosen, inputs, precision)
    with eager.forced_splits(8):
        forced = run_and_sync(inputs, precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(chosen, forced, strict=True))


@pytest.mark.parametrize("q_scale, kv_scale", [(-0.7, 1.3), (0.0, 1.0)])
def test_zero_and_negative_scales(make_inputs, q_scale, kv_scale):
    inputs = make_inputs(6, 16, 2000, 576, 256, device="cuda")
    inputs["q_scale"] = torch.tensor([q_scale], device="cuda")
    inputs["kv_scale"] = torch.tensor([kv_scale], device="cuda")
    assert_matches_float64_reference(run_and_sync(inputs), inputs)


@Q_DTYPES
@HEADS
def test_cuda_graph_gives_the_eager_bits(make_inputs, h_q, q_dtype):
    inputs = make_inputs(
        30, h_q, 3000, 576, 1024, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    assert schedule.describe(30, h_q, 1024) == "small heads, 1 token per CTA"
    expected = [t.clone() for t in run_and_sync(inputs)]
    buffers = [torch.full_like(t, math.nan) for t in expected]
    kwargs = dict(out=buffers[0], max_logits=buffers[1], lse=buffers[2])
    run_and_sync(inputs, **kwargs)  # warm-up outside capture
    capture_and_replay(lambda: sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs), buffers)
    assert all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True))
