"""The FP8 kernel with a bfloat16 q, which it quantises to e4m3 itself (one power-of-two scale per (token,
head) row), on an H100/H200 (``gpu`` marker; skipped elsewhere).

Every result is compared with two float64 references (``sparse_mla_prefill_reference``):

- on the same quantised inputs (``q_scale=None``: the rows as ``quantize_q_rows`` quantises them, each with
  its own scale): the kernel's own error, as for an e4m3 q (``test_kernel_gpu.py``). ``out`` rounds P to
  e4m3 (about 3% rms): ``||out - ref|| / ||ref|| <= 4e-2``, 5e-3 with ``precision="accurate"``.
  ``max_logits`` and ``lse`` carry the tensor cores' fast accumulation of the QK products in the default
  mode, measured at up to 1.9e-3 relative (the accurate mode sums them in float32: 2.3e-4; docs/perf-notes.md,
  "The logits: QK accumulation"): 5e-3 (absolute below 1);
- on the bfloat16 q itself (``q_scale=1.0``), reported and bounded loosely: the e4m3 rounding of q alone
  moves ``out`` by 1.4e-2 to 3.5e-2 and ``max_logits`` / ``lse`` by up to 5.8e-2 (float64 references on
  these tests' inputs, logits of unit variance), so ``out`` <= 7e-2 (default: P's rounding adds its 2e-2 to
  3e-2, about in quadrature) or 6e-2 (accurate), ``max_logits`` and ``lse`` <= 0.15.

Rows with no valid slot must hold the sentinels exactly. ``pytest -s`` prints both errors of each case.
"""

import math

import pytest
import torch
from cuda_graphs import assert_replays_match_eager, assert_same_outputs
from reference_checks import assert_outputs_match, with_every_invalid_index_kind

from q8kv8 import sparse_mla_q8kv8_prefill_fwd
from q8kv8.eager import forced_tiles_per_cta
from q8kv8.query import cast_q_fp8, dynamic_q_scale
from q8kv8.reference import quantize_q_rows, sparse_mla_prefill_reference

pytestmark = pytest.mark.gpu

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
OUT_TOLERANCE = {"default": 4e-2, "accurate": 5e-3}
STAT_TOLERANCE = 5e-3
BF16_OUT_TOLERANCE = {"default": 7e-2, "accurate": 6e-2}
BF16_STAT_TOLERANCE = 0.15


def bf16_inputs(make_inputs, *args, **kwargs) -> dict:
    """``make_inputs`` with a bfloat16 q (standard normal values) and no q_scale, on the GPU."""
    return make_inputs(*args, device="cuda", q_dtype=BF16, **kwargs)


def run_kernel(inputs: dict, **kwargs):
    outputs = sparse_mla_q8kv8_prefill_fwd(**inputs, **kwargs)
    torch.cuda.synchronize()
    return outputs


def check(outputs, inputs, precision="default", rows=None, against_bf16=True, label="") -> tuple:
    """Compare with both references (optionally on a subset of query rows); returns their
    ``||out - ref|| / ||ref||`` (the second None when ``against_bf16`` is False)."""
    assert inputs["q"].dtype == BF16 and inputs["q_scale"] is None
    out, max_logits, lse = outputs
    ref_inputs = dict(inputs)
    if rows is not None:
        for name in ("q", "indices", "topk_length"):
            if ref_inputs.get(name) is not None:
                ref_inputs[name] = inputs[name][rows]
        out, max_logits, lse = out[rows], max_logits[rows], lse[rows]
    same = sparse_mla_prefill_reference(**ref_inputs, chunk_rows=32)
    rel_same = assert_outputs_match((out, max_logits, lse), same, OUT_TOLERANCE[precision], STAT_TOLERANCE)
    rel_bf16 = None
    if against_bf16:
        plain = sparse_mla_prefill_reference(**ref_inputs | {"q_scale": 1.0}, chunk_rows=32)
        rel_bf16 = assert_outputs_match(
            (out, max_logits, lse), plain, BF16_OUT_TOLERANCE[precision], BF16_STAT_TOLERANCE
        )
    print(
        f"bf16 q {label} {precision}: ||out - ref|| / ||ref|| = {rel_same:.2e} (quantised rows), "
        f"{'n/a' if rel_bf16 is None else f'{rel_bf16:.2e}'} (bf16 q)"
    )
    return rel_same, rel_bf16


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("extras", ["plain", "sink_and_topk_length"])
@pytest.mark.parametrize("topk", [128, 2048])
@pytest.mark.parametrize("h_q", [64, 128, 48])
@pytest.mark.parametrize("d_qk", [512, 576])
def test_matches_both_references(make_inputs, d_qk, h_q, topk, extras, precision):
    s_kv = topk // 2 + 3 if topk == 128 else 65536
    with_extras = extras == "sink_and_topk_length"
    inputs = bf16_inputs(
        make_inputs, 37, h_q, s_kv, d_qk, topk, with_sink=with_extras, with_topk_length=with_extras
    )
    label = f"d_qk {d_qk} h {h_q} topk {topk} {extras}"
    check(run_kernel(inputs, precision=precision), inputs, precision, label=label)


def test_accurate_is_closer_than_default(make_inputs):
    """The accurate mode's P error stays visible against the quantised rows' reference."""
    inputs = bf16_inputs(make_inputs, 29, 128, 65536, 576, 512, with_sink=True, with_topk_length=True)
    inputs["indices"][3] = -1  # an empty row: exact sentinels in both modes
    accurate, _ = check(run_kernel(inputs, precision="accurate"), inputs, "accurate", label="accurate")
    default, _ = check(run_kernel(inputs), inputs, "default", label="default")
    assert accurate < default / 4, (accurate, default)


def median_relative_error(max_logits: torch.Tensor, reference) -> torch.Tensor:
    """Per head: the median over rows with a valid slot of ``|max_logits - ref| / |ref|``."""
    _, ref_max, ref_lse = reference
    full = torch.isfinite(ref_lse)
    error = (max_logits.double() - ref_max).abs() / ref_max.abs().clamp(min=1e-300)
    return torch.stack([error[:, head][full[:, head]].median() for head in range(max_logits.shape[1])])


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("d_qk", [512, 576])
def test_heads_of_very_different_magnitudes(make_inputs, d_qk, precision):
    """Per-head factors 2^-20 .. 1 (logits of unit variance in the largest heads, as in the other tests: at
    logits of hundreds the QK product's fast accumulation alone, ~2e-3 relative, moves P by more than the
    accurate mode's out tolerance): each row keeps e4m3's relative accuracy, so every head's max_logits is
    within a few percent of the bfloat16 q's (about 1%, float64 references on CPU), where the e4m3 kernel on
    a q cast with one power-of-two scale for the whole tensor (``cast_q_fp8``, ``dynamic_q_scale``) loses the
    small heads among e4m3's subnormals."""
    inputs = bf16_inputs(make_inputs, 48, 64, 8192, d_qk, 512, with_sink=True)
    factors = torch.exp2(torch.linspace(-20, 0, 64, device="cuda").round())
    inputs["q"] = (inputs["q"].float() * factors[None, :, None]).to(BF16)
    outputs = run_kernel(inputs, precision=precision)
    # Against the bf16 q only the logits are compared (q's rounding to e4m3 moves P by more than out's bound).
    check(outputs, inputs, precision, against_bf16=False, label=f"heads 2^-20..1 d_qk {d_qk}")
    plain = sparse_mla_prefill_reference(**inputs | {"q_scale": 1.0}, chunk_rows=32)
    per_row_error = median_relative_error(outputs[1], plain)
    assert per_row_error.max() < 0.03, per_row_error
    scale = dynamic_q_scale(inputs["q"])
    per_tensor = run_kernel(
        inputs | {"q": cast_q_fp8(inputs["q"], scale), "q_scale": scale}, precision=precision
    )
    per_tensor_error = median_relative_error(per_tensor[1], plain)
    # heads 0 and 1 (2^-20): about N(0, 2^-13) in e4m3 units per tensor, below the subnormals' step 2^-9
    assert per_tensor_error[:2].min() > 3 * per_row_error.max(), (per_tensor_error[:2], per_row_error.max())
    print(f"max_logits median relative error, worst head: {per_row_error.max():.2e} per row, "
          f"{per_tensor_error.max():.2e} per tensor")  # fmt: skip


def test_rows_at_the_ends_of_the_exponent_range(make_inputs):
    """Zero rows (scale 1), rows of bfloat16 subnormals (scale clamped to 2^-126), tiny and huge rows
    (2^-100, 2^30), rows whose amax is exactly 448 or 224 times a power of two, and single non-zero elements:
    the kernel's scales and roundings are the reference's. sm_scale 2^-30 keeps the 2^30 rows' logits near
    1: the softmax runs in float32, whose exponent differences lose all precision at logits of 10^9 (the
    tiny rows' logit scales then underflow to 0 in float32: their logits are 0, as the reference's ~1e-40)."""
    inputs = bf16_inputs(make_inputs, 16, 64, 3000, 512, 256, with_sink=True, with_topk_length=True)
    q = inputs["q"].float()
    factors = torch.tensor(
        [0.0, 2.0**-133, 2.0**-130, 2.0**-100, 2.0**-20, 1.0, 2.0**20, 2.0**30], device="cuda"
    )
    q = q * factors.repeat(8)[None, :, None]
    q[:, 8:16] = 0.0
    q[:, 8, 0] = 448.0  # amax exactly 448: scale 1, q / scale = 448
    q[:, 9, 5] = -224.0 * 2.0**-50  # amax 224 * 2^-50: scale 2^-51
    q[:, 10, 7] = 456.0 * 2.0**-126  # just above 448 * 2^-126: scale 2^-125
    q[:, 11, :] = 2.0**-133  # the smallest bfloat16 subnormal everywhere
    q[3] = 0.0  # a whole token of zero rows
    inputs["q"] = q.to(BF16)
    inputs["sm_scale"] = 2.0**-30
    _, row_scale = quantize_q_rows(inputs["q"])
    assert row_scale[0, 8].item() == 1.0 and row_scale[0, 9].item() == 2.0**-51
    assert row_scale[0, 10].item() == 2.0**-125 and row_scale[0, 11].item() == 2.0**-126
    assert (row_scale[3] == 1.0).all()
    outputs = run_kernel(inputs)
    check(outputs, inputs, against_bf16=False, label="extreme rows")
    assert (outputs[1][3][torch.isfinite(outputs[2][3])] == 0).all()  # zero rows: logits exactly 0


def test_every_invalid_index_kind_duplicates_and_sentinels(make_inputs, generator):
    inputs = bf16_inputs(make_inputs, 16, 64, 3000, 576, 256, invalid_fraction=0.0, with_sink=True)
    indices = with_every_invalid_index_kind(inputs["indices"], 3000, generator)
    indices[4:6] = -1  # rows with no valid slot
    inputs["indices"] = indices
    sink = inputs["attn_sink"]
    sink[0::3] = math.inf
    sink[1::3] = -math.inf
    out, max_logits, lse = run_kernel(inputs)
    check((out, max_logits, lse), inputs, label="invalid indices")
    assert (out[:, 0::3] == 0).all(), "sink +inf must zero out"
    assert (out[4:6] == 0).all() and (lse[4:6] == math.inf).all() and (max_logits[4:6] == -math.inf).all()


def test_topk_length_edges_clamped(make_inputs):
    inputs = bf16_inputs(make_inputs, 8, 128, 4000, 576, 512, with_topk_length=True)
    inputs["topk_length"] = torch.tensor([0, 1, 64, 65, 511, 512, 900, -7], dtype=torch.int32, device="cuda")
    out, max_logits, lse = run_kernel(inputs)
    check((out, max_logits, lse), inputs, label="topk_length edges")
    for row in (0, 7):  # 0 and negative: no slot visited
        assert (out[row] == 0).all() and (lse[row] == math.inf).all() and (max_logits[row] == -math.inf).all()


def test_poisoned_outputs_fully_written_and_empty_kv(make_inputs):
    inputs = bf16_inputs(make_inputs, 33, 48, 5000, 512, 256, with_sink=True, with_topk_length=True)
    out = torch.full((33, 48, 512), math.nan, dtype=BF16, device="cuda")
    max_logits = torch.full((33, 48), math.nan, device="cuda")
    lse = torch.full((33, 48), math.nan, device="cuda")
    result = run_kernel(inputs, out=out, max_logits=max_logits, lse=lse)
    assert result[0] is out and result[1] is max_logits and result[2] is lse
    check(result, inputs, label="given buffers")
    empty = run_kernel(inputs | {"kv": inputs["kv"][:0]})
    assert (empty[0] == 0).all() and (empty[1] == -math.inf).all() and (empty[2] == math.inf).all()


def test_grid_beyond_65535_rows(make_inputs, generator):
    s_q, s_kv = 70000, 4096
    inputs = bf16_inputs(make_inputs, 1, 64, s_kv, 576, 128)
    cuda_gen = torch.Generator(device="cuda").manual_seed(
        int(torch.randint(0, 2**31, (1,), generator=generator))
    )
    inputs["q"] = torch.randn(s_q, 64, 576, device="cuda", generator=cuda_gen).to(BF16)
    inputs["indices"] = torch.randint(
        -64, s_kv, (s_q, 1, 128), device="cuda", generator=cuda_gen, dtype=torch.int32
    )
    outputs = run_kernel(inputs)
    rows = torch.cat(
        [torch.tensor([0, 1, s_q - 2, s_q - 1]), torch.randint(0, s_q, (60,), generator=generator)]
    )
    check(outputs, inputs, rows=rows.cuda(), label="70000 rows")


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("d_qk, h_q, topk", [(576, 128, 512), (512, 64, 256), (576, 48, 2048)])
def test_persistent_kernel_bitwise_equals_one_tile_kernel(make_inputs, d_qk, h_q, topk, precision):
    """The persistent schedule (forced: 1, 2, 3 and 8 tiles per CTA, and the rule's own choice) gives the
    one-tile kernel's results bit for bit for a bfloat16 q, over tiles with no valid slot, full rows, odd and
    even block counts, in both precisions."""
    inputs = bf16_inputs(make_inputs, 1100, h_q, 5000, d_qk, topk, with_sink=True, with_topk_length=True)
    edges = torch.tensor([0, topk, 1, 64, 65, 128, 129, 0, 0, topk, 63], dtype=torch.int32)
    inputs["topk_length"][: len(edges)] = edges.cuda()
    with forced_tiles_per_cta(0):
        one_tile = [t.clone() for t in run_kernel(inputs, precision=precision)]
    check(one_tile, inputs, precision, rows=torch.arange(0, 1100, 37, device="cuda"), label="one tile")
    for tiles in (1, 2, 3, 8):
        with forced_tiles_per_cta(tiles):
            persistent = run_kernel(inputs, precision=precision)
        assert all(torch.equal(a, b) for a, b in zip(one_tile, persistent, strict=True)), tiles
    ruled = run_kernel(inputs, precision=precision)  # 1100+ tiles with topk_length: the rule's schedule
    assert all(torch.equal(a, b) for a, b in zip(one_tile, ruled, strict=True))


def test_repeated_launches_bitwise_equal(make_inputs):
    inputs = bf16_inputs(make_inputs, 512, 128, 8192, 576, 256, with_sink=True, with_topk_length=True)
    first = run_kernel(inputs)
    for _ in range(9):
        again = run_kernel(inputs)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True)), "launches differ"
    check(first, inputs, rows=torch.arange(0, 512, 7, device="cuda"), label="repeated")


@pytest.mark.parametrize("precision", ["default", "accurate"])
def test_rows_of_one_scale_match_the_e4m3_kernel(make_inputs, randn_fp8, precision):
    """A bfloat16 q that is an e4m3 q times one power of two s, every row's amax in (224, 448] e4m3 units:
    each row's scale is s and its quantisation gives the e4m3 q back, so the kernel computes what the e4m3
    kernel computes with q_scale = s (the same products, the same logit scale)."""
    inputs = make_inputs(40, 128, 6000, 576, 512, device="cuda", with_sink=True, with_topk_length=True)
    q_e4m3 = randn_fp8(40, 128, 576, device="cuda", scale=40.0).float()
    q_e4m3[..., 0] = 416.0  # amax in (224, 448] for every row
    q_e4m3 = q_e4m3.to(E4M3)
    scale = 2.0**-7
    q_bf16 = (q_e4m3.float() * scale).to(BF16)
    quantised, row_scale = quantize_q_rows(q_bf16)
    assert torch.equal(quantised.view(torch.uint8), q_e4m3.view(torch.uint8)) and (row_scale == scale).all()
    e4m3 = run_kernel(
        inputs | {"q": q_e4m3, "q_scale": torch.tensor([scale], device="cuda")}, precision=precision
    )
    bf16 = run_kernel(inputs | {"q": q_bf16, "q_scale": None}, precision=precision)
    bitwise = all(torch.equal(a, b) for a, b in zip(e4m3, bf16, strict=True))
    rel = assert_outputs_match(bf16, [t.double() for t in e4m3], OUT_TOLERANCE[precision], STAT_TOLERANCE)
    print(f"bf16 q vs e4m3 q on the same e4m3 rows, {precision}: bitwise {bitwise}, out {rel:.2e}")


def test_cuda_graph_replay(make_inputs):
    inputs = bf16_inputs(make_inputs, 24, 128, 3000, 576, 256, with_sink=True, with_topk_length=True)
    graph, buffers = assert_replays_match_eager(
        lambda **buffers: run_kernel(inputs, **buffers),
        lambda **buffers: sparse_mla_q8kv8_prefill_fwd(**inputs, **buffers),
        replays=3,
    )
    inputs["q"].copy_(inputs["q"] * 3)  # new values in the captured q: read at replay
    want = [t.clone() for t in run_kernel(inputs)]
    graph.replay()
    torch.cuda.synchronize()
    assert_same_outputs(buffers.values(), want)
