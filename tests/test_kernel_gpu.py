"""The SM90 kernel against the float64 reference, on an H100/H200 (``gpu`` marker; skipped elsewhere).

Tolerances: ``out`` rounds P to e4m3 before the PV product (about 3% rms), so
``||out - ref|| / ||ref|| <= 4e-2`` (``precision="accurate"`` keeps P as two e4m3 terms: 5e-3);
``max_logits`` and ``lse`` come from exact fp8 products accumulated in f32, so they must agree to
1e-2 relative (absolute below 1). Rows with no valid slot must hold the sentinels exactly.
"""

import contextlib
import math

import pytest
import torch
from cuda_graphs import assert_replays_match_eager, assert_same_outputs, capture, poison_and_replay
from reference_checks import (
    SAME_LOGITS,
    assert_outputs_match,
    grid_s_kv,
    logit_tolerances,
    out_tolerances,
    reference_grid,
    with_every_invalid_index_kind,
)

from q8kv8 import sparse_mla_q8kv8_prefill_fwd, topk_length_from_seqlens
from q8kv8.eager import forced_splits, forced_tiles_per_cta
from q8kv8.metadata import PRECISIONS
from q8kv8.reference import sparse_mla_prefill_reference

pytestmark = pytest.mark.gpu

OUT_TOLERANCE = 4e-2
ACCURATE_OUT_TOLERANCE = 5e-3
STAT_TOLERANCE = 1e-2


def run_kernel(inputs: dict, **kwargs):
    outputs = sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs)
    torch.cuda.synchronize()
    return outputs


def assert_matches_reference(outputs, inputs, rows=None, out_tolerance=OUT_TOLERANCE):
    """Compare kernel outputs with the float64 reference (optionally on a subset of query rows);
    returns ||out - ref|| / ||ref||."""
    out, max_logits, lse = outputs
    ref_inputs = dict(inputs)
    if rows is not None:
        ref_inputs["q"] = inputs["q"][rows]
        ref_inputs["indices"] = inputs["indices"][rows]
        if inputs.get("topk_length") is not None:
            ref_inputs["topk_length"] = inputs["topk_length"][rows]
        out, max_logits, lse = out[rows], max_logits[rows], lse[rows]
    reference = sparse_mla_prefill_reference(**ref_inputs, chunk_rows=32)
    return assert_outputs_match((out, max_logits, lse), reference, out_tolerance, STAT_TOLERANCE)


@reference_grid
def test_matches_reference(make_inputs, d_qk, h_q, topk, s_kv_kind, extras):
    s_kv = grid_s_kv(topk, s_kv_kind)
    with_extras = extras == "sink_and_topk_length"
    inputs = make_inputs(
        37, h_q, s_kv, d_qk, topk, device="cuda", with_sink=with_extras, with_topk_length=with_extras
    )
    assert_matches_reference(run_kernel(inputs), inputs)


def test_every_invalid_index_kind_and_duplicates(make_inputs, generator):
    inputs = make_inputs(16, 64, 3000, 576, 256, device="cuda", invalid_fraction=0.0)
    inputs["indices"] = with_every_invalid_index_kind(inputs["indices"], 3000, generator)
    assert_matches_reference(run_kernel(inputs), inputs)


def test_sink_infinities_and_empty_rows(make_inputs):
    inputs = make_inputs(12, 128, 500, 512, 128, device="cuda", with_sink=True)
    sink = inputs["attn_sink"]
    sink[0::3] = math.inf
    sink[1::3] = -math.inf
    inputs["indices"][2:5] = -1  # rows with no valid slot
    out, max_logits, lse = run_kernel(inputs)
    assert_matches_reference((out, max_logits, lse), inputs)
    assert (out[:, 0::3] == 0).all(), "sink +inf must zero out"
    assert (out[2:5] == 0).all() and (lse[2:5] == math.inf).all() and (max_logits[2:5] == -math.inf).all()


def test_topk_length_edges_clamped(make_inputs):
    inputs = make_inputs(8, 64, 4000, 576, 512, device="cuda", with_topk_length=True)
    inputs["topk_length"] = torch.tensor([0, 1, 64, 65, 511, 512, 900, -7], dtype=torch.int32, device="cuda")
    out, max_logits, lse = run_kernel(inputs)
    assert_matches_reference((out, max_logits, lse), inputs)
    for row in (0, 7):  # 0 and negative: no slot visited
        assert (out[row] == 0).all() and (lse[row] == math.inf).all() and (max_logits[row] == -math.inf).all()


def test_non_unit_scales_and_sm_scale(make_inputs, randn_fp8):
    inputs = make_inputs(20, 64, 2048, 576, 256, device="cuda", with_sink=True)
    inputs["q"] = randn_fp8(20, 64, 576, device="cuda", scale=0.25)
    inputs["kv"] = randn_fp8(2048, 1, 576, device="cuda", scale=0.25)
    inputs["q_scale"] = torch.tensor([0.37], device="cuda")
    inputs["kv_scale"] = torch.tensor(1.9, device="cuda")
    inputs["sm_scale"] = 0.5
    assert_matches_reference(run_kernel(inputs), inputs)


@pytest.mark.parametrize("q_scale, kv_scale", [(-0.7, 1.3), (0.0, 1.0), (0.9, -0.4)])
def test_zero_and_negative_scales(make_inputs, q_scale, kv_scale):
    """Not sensible dequantisation scales, but defined: logits change sign or vanish."""
    inputs = make_inputs(10, 64, 900, 512, 256, device="cuda", with_topk_length=True)
    inputs["q_scale"] = torch.tensor([q_scale], device="cuda")
    inputs["kv_scale"] = torch.tensor([kv_scale], device="cuda")
    assert_matches_reference(run_kernel(inputs), inputs)


@pytest.mark.parametrize("h_q", [16, 48, 96])
def test_head_counts_not_a_multiple_of_64(make_inputs, h_q):
    inputs = make_inputs(9, h_q, 1000, 576, 128, device="cuda", with_sink=True, with_topk_length=True)
    assert_matches_reference(run_kernel(inputs), inputs)


SCHEDULES = {
    "one tile": lambda: forced_tiles_per_cta(0),
    "persistent": lambda: forced_tiles_per_cta(2),
    "split": lambda: forced_splits(2),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("h_q", [3, 48, 100])
def test_partly_filled_head_tiles_write_only_their_heads(make_inputs, h_q, precision, q_dtype, schedule):
    """h_q not a multiple of 64: a token's last tile of 64 rows holds fewer of its heads (the other rows are
    the next token's heads, zeros past q's end). Every schedule and q dtype matches the reference, writes
    every output row (poisoned before) and nothing past the outputs' last row."""
    s_q = 7
    inputs = make_inputs(
        s_q, h_q, 1000, 576, 256, device="cuda", with_sink=True, with_topk_length=True, q_dtype=q_dtype
    )
    inputs["topk_length"][2] = 0  # a token without a valid slot: the sentinels
    poisoned = (
        torch.full((s_q + 1, h_q, 512), math.nan, dtype=torch.bfloat16, device="cuda"),
        torch.full((s_q + 1, h_q), math.nan, device="cuda"),
        torch.full((s_q + 1, h_q), math.nan, device="cuda"),
    )
    with SCHEDULES[schedule]():
        result = run_kernel(
            inputs,
            precision=precision,
            out=poisoned[0][:s_q],
            max_logits=poisoned[1][:s_q],
            lse=poisoned[2][:s_q],
        )
    tolerance = ACCURATE_OUT_TOLERANCE if precision == "accurate" else OUT_TOLERANCE
    assert_matches_reference(result, inputs, out_tolerance=tolerance)
    for buffer in poisoned:  # the row past the outputs: untouched
        assert buffer[s_q].isnan().all()


def test_poisoned_outputs_fully_written(make_inputs):
    inputs = make_inputs(33, 128, 5000, 512, 256, device="cuda", with_sink=True, with_topk_length=True)
    out = torch.full((33, 128, 512), math.nan, dtype=torch.bfloat16, device="cuda")
    max_logits = torch.full((33, 128), math.nan, device="cuda")
    lse = torch.full((33, 128), math.nan, device="cuda")
    result = run_kernel(inputs, out=out, max_logits=max_logits, lse=lse)
    assert result[0] is out and result[1] is max_logits and result[2] is lse
    assert_matches_reference(result, inputs)


def test_repeated_launches_bitwise_equal(make_inputs):
    inputs = make_inputs(512, 128, 8192, 576, 256, device="cuda", with_sink=True, with_topk_length=True)
    first = run_kernel(inputs)
    for _ in range(9):
        again = run_kernel(inputs)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), "launches differ"
    assert_matches_reference(first, inputs)


def test_grid_beyond_65535_rows(make_inputs, generator):
    s_q, h_q, s_kv, d_qk, topk = 70000, 64, 4096, 576, 128
    inputs = make_inputs(1, h_q, s_kv, d_qk, topk, device="cuda")
    cuda_gen = torch.Generator(device="cuda").manual_seed(
        int(torch.randint(0, 2**31, (1,), generator=generator))
    )
    inputs["q"] = torch.randn(s_q, h_q, d_qk, device="cuda", generator=cuda_gen).to(torch.float8_e4m3fn)
    inputs["indices"] = torch.randint(
        -64, s_kv, (s_q, 1, topk), device="cuda", generator=cuda_gen, dtype=torch.int32
    )
    outputs = run_kernel(inputs)
    rows = torch.cat(
        [torch.tensor([0, 1, s_q - 2, s_q - 1]), torch.randint(0, s_q, (60,), generator=generator)]
    )
    assert_matches_reference(outputs, inputs, rows=rows.cuda())


def test_left_packed_with_topk_length_matches_none(make_inputs, generator):
    s_q, topk, s_kv = 64, 512, 6000
    inputs = make_inputs(s_q, 64, s_kv, 576, topk, device="cuda", invalid_fraction=0.0)
    seqlens = torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    seqlens[:3] = torch.tensor([0, topk, 1], dtype=torch.int32)
    slots = torch.arange(topk)
    indices = inputs["indices"].cpu().masked_fill((slots >= seqlens[:, None])[:, None, :], -1)
    inputs["indices"] = indices.cuda()
    plain = run_kernel(inputs)
    inputs_tl = dict(inputs, topk_length=topk_length_from_seqlens(seqlens.cuda(), topk))
    packed = run_kernel(inputs_tl)
    assert torch.equal(plain[1], packed[1]) and torch.equal(plain[2], packed[2])
    ulp = (plain[0].float().abs() * 2.0**-7).clamp(min=2.0**-133)
    assert ((plain[0].float() - packed[0].float()).abs() <= ulp).all()
    assert_matches_reference(packed, inputs_tl)


def test_cuda_graph_replay(make_inputs):
    inputs = make_inputs(24, 128, 3000, 576, 256, device="cuda", with_sink=True, with_topk_length=True)
    assert_replays_match_eager(
        lambda **buffers: run_kernel(inputs, **buffers),
        lambda **buffers: sparse_mla_q8kv8_prefill_fwd(**inputs, **buffers),
    )


@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["e4m3", "bf16"])
def test_runs_on_callers_stream(make_inputs, q_dtype):
    """The call must queue on the current stream: behind a slow copy issued there just before it (of an
    e4m3 q, or of a bf16 q, which the kernel's consumers load themselves)."""
    inputs = make_inputs(16, 64, 2000, 512, 256, device="cuda", with_topk_length=True, q_dtype=q_dtype)
    q_later = make_inputs(16, 64, 2000, 512, 256, device="cuda", q_dtype=q_dtype)["q"]
    expected = run_kernel(dict(inputs, q=q_later))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        inputs["q"].copy_(q_later)
        got = sparse_mla_q8kv8_prefill_fwd(**inputs)
    torch.cuda.synchronize()
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("topk, s_kv", [(128, 70), (512, 65536), (2048, 65536)])
@pytest.mark.parametrize("h_q", [64, 128])
@pytest.mark.parametrize("d_qk", [512, 576])
def test_accurate_precision_matches_reference(make_inputs, d_qk, h_q, topk, s_kv):
    inputs = make_inputs(29, h_q, s_kv, d_qk, topk, device="cuda", with_sink=True, with_topk_length=True)
    inputs["indices"][3] = -1  # an empty row: exact sentinels in this mode too
    accurate = assert_matches_reference(
        run_kernel(inputs, precision="accurate"), inputs, out_tolerance=ACCURATE_OUT_TOLERANCE
    )
    default = assert_matches_reference(run_kernel(inputs), inputs)
    assert accurate < default / 4, (accurate, default)


def test_concurrent_streams(make_inputs):
    """Launches running at once on two streams, repeatedly, give the results of one at a time."""
    first = make_inputs(400, 64, 9000, 512, 256, device="cuda", with_topk_length=True)
    second = make_inputs(300, 128, 7000, 576, 384, device="cuda", with_sink=True)
    want = [[t.clone() for t in run_kernel(inputs)] for inputs in (first, second)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got = [[], []]
    for _ in range(5):
        for stream in streams:
            stream.wait_stream(torch.cuda.current_stream())
        for k, (stream, inputs) in enumerate(zip(streams, (first, second), strict=True)):
            with torch.cuda.stream(stream):
                got[k].append(sparse_mla_q8kv8_prefill_fwd(**inputs))
        for stream in streams:
            torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for k in range(2):
        for outputs in got[k]:
            assert all(torch.equal(a, b) for a, b in zip(want[k], outputs, strict=True))


def test_cuda_graph_replays_repeatedly(make_inputs):
    inputs = make_inputs(300, 128, 3000, 576, 256, device="cuda", with_topk_length=True)
    eager = [t.clone() for t in run_kernel(inputs)]
    out, max_logits, lse = buffers = tuple(torch.empty_like(t) for t in eager)
    graph = capture(lambda: sparse_mla_q8kv8_prefill_fwd(**inputs, out=out, max_logits=max_logits, lse=lse))
    for _ in range(4):
        poison_and_replay(graph, buffers)
        run_kernel(inputs)  # eager launches between replays, on the same stream
        torch.cuda.synchronize()
        assert_same_outputs(buffers, eager)


def test_side_stream_ordered_by_events(make_inputs, randn_fp8):
    """A call on a non-default stream, ordered only by events: it waits for an event recorded after its
    input is written on the main stream, and the main stream reads its outputs after waiting for an event
    recorded after it (no device-wide sync before the comparison)."""
    inputs = make_inputs(16, 64, 2000, 576, 256, device="cuda", with_sink=True, with_topk_length=True)
    q_later = randn_fp8(16, 64, 576, device="cuda")
    expected = run_kernel(dict(inputs, q=q_later))
    out, max_logits, lse = (torch.full_like(t, math.nan) for t in expected)
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)  # the buffers' fill
    written, done = torch.cuda.Event(), torch.cuda.Event()
    torch.cuda._sleep(100_000_000)  # on main: the write below lands tens of ms later
    inputs["q"].copy_(q_later)
    written.record(main)
    side.wait_event(written)
    with torch.cuda.stream(side):
        got = sparse_mla_q8kv8_prefill_fwd(**inputs, out=out, max_logits=max_logits, lse=lse)
        done.record(side)
    assert not done.query(), "the call should be queued on the side stream behind the event"
    main.wait_event(done)
    for a, b in zip(expected, got, strict=True):  # read on the main stream
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("d_qk", [512, 576])
def test_large_logits_move_the_lazy_max(make_inputs, randn_fp8, d_qk, precision):
    """Logits with a std of ~8: the running max passes the lazy threshold on many later pairs, so the
    speculative softmax's synchronous redo (and the O rescale) runs often."""
    inputs = make_inputs(24, 128, 8192, d_qk, 2048, device="cuda", with_sink=True, invalid_fraction=0.1)
    inputs["q"] = randn_fp8(24, 128, d_qk, device="cuda", scale=8.0)
    tolerance = ACCURATE_OUT_TOLERANCE if precision == "accurate" else OUT_TOLERANCE
    assert_matches_reference(run_kernel(inputs, precision=precision), inputs, out_tolerance=tolerance)


LARGE_LOGIT_TOLERANCE = logit_tolerances(3e-3, 5e-4)
"""max_logits and lse at logits up to ~30, relative (absolute below 1): the tensor cores' fast accumulation of
the QK products over the whole of d_qk (default; measured up to 1.9e-3), and S summed in float32 every 2
k-steps (accurate; measured up to 3.3e-4 on rows led by one slot); docs/perf-notes.md, "The logits: QK
accumulation"."""
OUT_TOLERANCES = out_tolerances(OUT_TOLERANCE, ACCURATE_OUT_TOLERANCE)

LARGE_LOGIT_SCHEDULES = {  # h_q, q dtype, schedule
    "one tile": (64, torch.float8_e4m3fn, lambda: forced_tiles_per_cta(0)),
    "persistent": (64, torch.float8_e4m3fn, lambda: forced_tiles_per_cta(2)),
    "split": (64, torch.float8_e4m3fn, lambda: forced_splits(2)),
    "small heads": (16, torch.float8_e4m3fn, contextlib.nullcontext),
    "bf16 q one tile": (64, torch.bfloat16, lambda: forced_tiles_per_cta(0)),
    "bf16 q persistent": (64, torch.bfloat16, lambda: forced_tiles_per_cta(2)),
    "bf16 q small heads": (32, torch.bfloat16, contextlib.nullcontext),
}


@pytest.mark.parametrize("schedule", list(LARGE_LOGIT_SCHEDULES))
@pytest.mark.parametrize("d_qk", [512, 576])
def test_logits_up_to_30_in_every_precision(make_inputs, d_qk, schedule):
    """q and kv ~ N(0, 1) in e4m3 (bf16 q: against its quantised rows), sm_scale 0.25, unit scales: logits up
    to ~30, where the QK product's accumulation error shows in max_logits and lse (``LARGE_LOGIT_TOLERANCE``,
    tighter than the other tests' 1e-2; 5e-4 with S summed in float32). Each precision buys what it names:
    "accurate_out" keeps P as two terms and computes S as "default" does, "accurate_logits" as "accurate"
    does, so each gives that precision's max_logits and lse bit for bit. At these logits out also carries
    S's error: P's two terms cut out's error 4x where S is the same ("accurate" against "accurate_logits";
    measured 1.8e-3 against 1.1e-2 on an H100) and at least 2x on the default's S ("accurate_out" against
    "default"; 3.3e-3 against 0.9-1.1e-2)."""
    h_q, q_dtype, forced = LARGE_LOGIT_SCHEDULES[schedule]
    inputs = make_inputs(48, h_q, 4096, d_qk, 2048, device="cuda", invalid_fraction=0.0, q_dtype=q_dtype)
    one = torch.ones(1, device="cuda")
    inputs |= {"sm_scale": 0.25, "kv_scale": one, "q_scale": None if q_dtype == torch.bfloat16 else one}
    reference = sparse_mla_prefill_reference(**inputs, chunk_rows=32)
    assert reference[1].max() > 20, "logits not as large as meant"
    results, errors = {}, {}
    for precision in PRECISIONS:
        with forced():
            results[precision] = run_kernel(inputs, precision=precision)
        errors[precision] = assert_outputs_match(
            results[precision], reference, OUT_TOLERANCES[precision], LARGE_LOGIT_TOLERANCE[precision]
        )
    for precision, same in SAME_LOGITS.items():
        assert torch.equal(results[precision][1], results[same][1]), precision
        assert torch.equal(results[precision][2], results[same][2]), precision
    assert errors["accurate"] < errors["accurate_logits"] / 4, errors
    assert errors["accurate_out"] < errors["default"] / 2, errors


@pytest.mark.parametrize("d_qk", [512, 576])
def test_increasing_logits_rescale_every_pair(make_inputs, d_qk):
    """Logits that grow along the slots: every pair's max passes the running max (redo every pair)."""
    inputs = make_inputs(8, 64, 2048, d_qk, 1024, device="cuda", invalid_fraction=0.0)
    q = inputs["q"].float()
    q[:] = q[0:1, 0:1]  # every row the same query
    direction = q[0, 0] / q[0, 0].norm()
    kv = inputs["kv"].float()
    kv = kv - (kv[:, 0] @ direction)[:, None, None] * direction  # orthogonal to q
    ramp = torch.linspace(-30, 30, 2048, device="cuda")[:, None, None]
    kv = kv + ramp * direction * d_qk**0.5 / q[0, 0].norm()
    inputs["q"], inputs["kv"] = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
    inputs["indices"] = torch.arange(1024, dtype=torch.int32, device="cuda").repeat(8, 1, 1) * 2
    assert_matches_reference(run_kernel(inputs), inputs)


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("d_qk, h_q, topk", [(576, 128, 512), (512, 64, 256), (576, 64, 2048)])
def test_persistent_kernel_bitwise_equals_one_tile_kernel(make_inputs, d_qk, h_q, topk, precision):
    """The persistent kernel (forced: 1, 2, 3 and 8 tiles per CTA) gives the one-tile kernel's results
    bit for bit, over tiles with no valid slot, full rows, odd and even block counts, in both precisions."""
    inputs = make_inputs(203, h_q, 5000, d_qk, topk, device="cuda", with_sink=True, with_topk_length=True)
    edges = torch.tensor([0, topk, 1, 64, 65, 128, 129, 0, 0, topk, 63], dtype=torch.int32)
    inputs["topk_length"][: len(edges)] = edges.cuda()
    with forced_tiles_per_cta(0):
        one_tile = [t.clone() for t in run_kernel(inputs, precision=precision)]
    tolerance = ACCURATE_OUT_TOLERANCE if precision == "accurate" else OUT_TOLERANCE
    assert_matches_reference(one_tile, inputs, out_tolerance=tolerance)
    for tiles in (1, 2, 3, 8):
        with forced_tiles_per_cta(tiles):
            persistent = run_kernel(inputs, precision=precision)
        assert all(torch.equal(a, b) for a, b in zip(one_tile, persistent, strict=True)), tiles
