"""The split schedule (a short grid: each tile computed by a cluster of CTAs over ranges of its index slots,
which merge their results) on an H100/H200 (``gpu`` marker): against the float64 reference with the one-tile
kernel's tolerances (``test_kernel_gpu``), the no-valid-slot sentinels exact, the same bits on every run, the
rule's choice, the C++ fast path and CUDA graphs; and the split tail (a longer grid's last partial wave
split after a one-tile launch of the other tokens)."""

import math

import pytest
import torch
from cuda_graphs import capture_and_replay
from reference_checks import assert_matches_float64_reference, run_and_sync

from q8kv8 import eager, native, schedule, sparse_mla_q8kv8_prefill_fwd
from q8kv8.prefill_call import PrefillCall

pytestmark = pytest.mark.gpu

Q_DTYPES = pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])


@Q_DTYPES
@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("parts", schedule.SPLIT_PARTS)
@pytest.mark.parametrize(("d_qk", "h_q", "topk"), [(576, 64, 2048), (512, 128, 512)])
def test_matches_reference_and_is_stable(make_inputs, q_dtype, precision, parts, d_qk, h_q, topk):
    """Sink, topk_length and invalid indices; the second run gives the same bits."""
    inputs = make_inputs(
        9, h_q, 70000, d_qk, topk, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    with eager.forced_splits(parts):
        first = [t.clone() for t in run_and_sync(inputs, precision=precision)]
        second = run_and_sync(inputs, precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert_matches_float64_reference(first, inputs, precision)


@Q_DTYPES
@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("parts", schedule.SPLIT_PARTS)
@pytest.mark.parametrize("split_from", [1, 5, 8])
def test_split_tail_is_the_one_tile_rows_then_the_split_rows(
    make_inputs, q_dtype, precision, parts, split_from
):
    """Split from token ``split_from`` of 9: the rows before it are the one-tile kernel's bits, the others
    the whole split schedule's; all of them match the reference (sink, topk_length, invalid indices; two
    tiles a token, the second partly filled)."""
    inputs = make_inputs(
        9, 100, 70000, 576, 1024, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    with eager.forced_splits(parts, split_from):
        tail = [t.clone() for t in run_and_sync(inputs, precision=precision)]
    with eager.forced_splits(1):
        one_tile = [t.clone() for t in run_and_sync(inputs, precision=precision)]
    with eager.forced_splits(parts):
        split = run_and_sync(inputs, precision=precision)
    for a, b, c in zip(tail, one_tile, split, strict=True):
        assert torch.equal(a[:split_from], b[:split_from]) and torch.equal(a[split_from:], c[split_from:])
    assert_matches_float64_reference(tail, inputs, precision)


def test_split_tail_is_complete_for_the_next_kernel_on_the_stream(make_inputs):
    """A split tail's launches overlap (the split one may start before the one-tile one ends, and ends
    after it): a copy queued right behind them, without a host synchronisation, sees every row written
    (into NaN-poisoned outputs), the same bits as a synchronised run."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_q = 2 * sms + 10  # two waves of one tile per CTA, then 10 tokens split in 8
    inputs = make_inputs(s_q, 64, 70000, 576, 2048, device="cuda")
    assert schedule.choose(s_q, 64, 2048, False, 0) == (0, 8, 2 * sms)
    expected = [t.clone() for t in run_and_sync(inputs)]
    for _ in range(3):
        buffers = [torch.full_like(t, math.nan) for t in expected]
        torch.cuda.synchronize()
        sparse_mla_q8kv8_prefill_fwd(**inputs, out=buffers[0], max_logits=buffers[1], lse=buffers[2])
        copies = [t.clone() for t in buffers]  # queued behind the launches
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(copies, expected, strict=True))


@pytest.mark.parametrize("parts", schedule.SPLIT_PARTS)
def test_sentinels_sink_infinities_and_ranges_without_a_valid_slot(make_inputs, parts):
    """Rows with no valid slot hold the sentinels exactly; a sink of +inf zeroes out, -inf drops out; rows
    whose valid slots lie in one range (topk_length short, or the indices of the other ranges invalid)."""
    topk = 1024
    inputs = make_inputs(12, 64, 5000, 576, topk, device="cuda", with_sink=True, with_topk_length=True)
    inputs["attn_sink"][0::3] = math.inf
    inputs["attn_sink"][1::3] = -math.inf
    inputs["indices"][2:4] = -1  # no valid slot
    inputs["indices"][4, :, : topk // 2] = -1  # valid slots in the later ranges only
    inputs["indices"][5, :, topk // 4 :] = -1  # in the first range only
    inputs["topk_length"][:] = topk
    inputs["topk_length"][6:8] = torch.tensor([0, 1], dtype=torch.int32)
    inputs["topk_length"][8] = topk // 2 + 1  # the last ranges empty
    with eager.forced_splits(parts):
        out, max_logits, lse = run_and_sync(inputs)
    assert_matches_float64_reference((out, max_logits, lse), inputs)
    empty = [2, 3, 6]
    assert (
        (out[empty] == 0).all() and (lse[empty] == math.inf).all() and (max_logits[empty] == -math.inf).all()
    )
    assert (out[:, 0::3] == 0).all(), "sink +inf must zero out"


def test_rule_splits_short_grids_only(make_inputs):
    """The rule's choice: a short grid is split (and gives the forced schedule's bits), a full one is not."""
    assert schedule.split_tokens(1, 1, 2048, 0) == (8, 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert schedule.splits(sms // 11, 2048, 0) == 8
    assert schedule.splits(sms // 11 + 1, 2048, 0) == 4  # clusters of 8 would not all fit at once
    assert schedule.splits(sms // 11, 1024, 0) == 8  # one pair of blocks per range at least
    assert schedule.splits(sms // 11, 768, 0) == 4
    assert schedule.splits(sms // 5, 2048, 0) == 4
    assert schedule.splits(sms // 4, 2048, 0) == 2  # clusters of 4 would not all fit at once
    assert schedule.splits(sms // 3, 2048, 0) == 2  # 3 parts would not divide the d tiles
    assert schedule.splits(sms // 2, 2048, 0) == 2
    assert schedule.splits(sms // 2 + 1, 2048, 0) == 1
    assert schedule.splits(1, 512, 0) == 4  # one pair of blocks per range at least
    assert schedule.splits(1, 256, 0) == 2
    assert schedule.splits(1, 128, 0) == 1
    inputs = make_inputs(sms // 5, 64, 3000, 576, 2048, device="cuda", with_topk_length=True)
    chosen = [t.clone() for t in run_and_sync(inputs)]
    with eager.forced_splits(4):
        forced = run_and_sync(inputs)
    assert all(torch.equal(a, b) for a, b in zip(chosen, forced, strict=True))
    with eager.forced_splits(1):
        one_tile = run_and_sync(inputs)
    assert not torch.equal(chosen[0], one_tile[0])  # another schedule ran (the same result up to rounding)


@Q_DTYPES
@pytest.mark.parametrize("tail", [False, True], ids=["whole", "tail"])
def test_fast_path_and_cuda_graph_give_the_python_paths_bits(make_inputs, q_dtype, tail):
    """The rule splits this grid (whole, or its last 3 tokens after a wave of one-tile CTAs); the C++ fast
    path (registered by the first call) launches the same variants with the Python path's results, on the
    current stream and inside a CUDA graph capture."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    s_q = sms + 3 if tail else 20
    inputs = make_inputs(
        s_q, 64, 3000, 576, 2048, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    native.disable()  # the first call takes the Python path and registers device and variants again
    expected = [t.clone() for t in run_and_sync(inputs)]
    if native.load() is None:
        pytest.skip("the C++ fast path did not build")
    call_plan = native.load().plan(PrefillCall(**inputs, out=None, max_logits=None, lse=None))
    splits, split_from = schedule.split_tokens(s_q, 1, 2048, 0)  # the tail's 3 tiles: in 8 parts
    assert splits > 1 and split_from == (sms if tail else 0)
    assert call_plan == (0, splits, split_from), call_plan  # taken, split as the Python path's rule
    with eager.forced_splits(splits, split_from):
        forced = run_and_sync(inputs)
    assert all(torch.equal(a, b) for a, b in zip(forced, expected, strict=True))
    fast = run_and_sync(inputs)
    assert all(torch.equal(a, b) for a, b in zip(fast, expected, strict=True))
    buffers = [torch.full_like(t, math.nan) for t in expected]
    kwargs = dict(out=buffers[0], max_logits=buffers[1], lse=buffers[2])
    run_and_sync(inputs, **kwargs)  # warm-up outside capture
    capture_and_replay(lambda: sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs), buffers)
    assert all(torch.equal(a, b) for a, b in zip(buffers, expected, strict=True))
