"""The float64 reference against hand-computed cases and a per-element loop, and the kernel's quantisation of
a bfloat16 q (``quantize_q_rows``) against its definition.

Hand cases use small d_qk and d_v and values that fp8 e4m3 holds exactly, so their expected results are
exact or follow from a line of math; float64 comparisons use a relative tolerance of 1e-12.
"""

import fractions
import math

import pytest
import torch

from q8kv8.reference import quantize_q_rows, sparse_mla_prefill_reference

FP8 = torch.float8_e4m3fn
TOL = {"rtol": 1e-12, "atol": 1e-12}
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def fp8_exact(values) -> torch.Tensor:
    """``values`` as an fp8 e4m3 tensor, asserting that fp8 holds each of them exactly."""
    exact = torch.tensor(values, dtype=torch.float64)
    converted = exact.to(FP8)
    assert torch.equal(converted.to(torch.float64), exact)
    return converted


# One query row, one head, d_qk = 4, d_v = 2; kv rows as [s_kv, 1, d_qk].
Q = fp8_exact([[[1.0, 2.0, 0.0, 1.0]]])
KV = fp8_exact([[[1.0, 1.0, 1.0, 1.0]], [[2.0, 0.0, 1.0, 0.0]], [[0.5, 1.5, -1.0, 4.0]]])
D_V = 2
DOTS = [4.0, 2.0, 7.5]  # q . kv[j] for j = 0, 1, 2


def reference(indices, *, q=Q, kv=KV, sm_scale=1.0, q_scale=1.0, kv_scale=1.0, **kwargs):
    indices = torch.tensor(indices, dtype=torch.int32).reshape(q.shape[0], 1, -1)
    return sparse_mla_prefill_reference(q, kv, indices, sm_scale, q_scale, kv_scale, D_V, **kwargs)


def expected_softmax(slots: list[int], scale: float, kv_scale: float = 1.0):
    """Hand softmax over ``slots`` (with repeats) of the one-row problem: (out, max_logit, lse)."""
    logits = [DOTS[j] * scale for j in slots]
    top = max(logits)
    lse = top + math.log(sum(math.exp(logit - top) for logit in logits))
    weights = [math.exp(logit - lse) for logit in logits]
    out = [
        sum(w * KV[j, 0, d].item() * kv_scale for w, j in zip(weights, slots, strict=True))
        for d in range(D_V)
    ]
    return torch.tensor([[out]], dtype=torch.float64), top, lse


def assert_sentinel_row(out, max_logits, lse, row=0):
    assert torch.equal(out[row], torch.zeros_like(out[row]))
    assert torch.equal(max_logits[row], torch.full_like(max_logits[row], -math.inf))
    assert torch.equal(lse[row], torch.full_like(lse[row], math.inf))


def test_one_valid_slot_returns_that_value_row_and_logit():
    out, max_logits, lse = reference([1, -1], q_scale=0.5, kv_scale=2.0, sm_scale=0.25)
    logit = 2.0 * 0.5 * 2.0 * 0.25
    assert torch.equal(out, torch.tensor([[[4.0, 0.0]]], dtype=torch.float64))
    assert max_logits.item() == logit
    assert lse.item() == logit


def test_two_slots_follow_the_hand_softmax():
    out, max_logits, lse = reference([0, 2], sm_scale=0.3)
    expected_out, expected_max, expected_lse = expected_softmax([0, 2], 0.3)
    torch.testing.assert_close(out, expected_out, **TOL)
    assert max_logits.item() == pytest.approx(expected_max, rel=1e-12)
    assert lse.item() == pytest.approx(expected_lse, rel=1e-12)


def test_scales_multiply_logits_and_values():
    out, max_logits, lse = reference([0, 1, 2], q_scale=0.75, kv_scale=1.5, sm_scale=0.2)
    expected_out, expected_max, expected_lse = expected_softmax([0, 1, 2], 0.75 * 1.5 * 0.2, kv_scale=1.5)
    torch.testing.assert_close(out, expected_out, **TOL)
    assert max_logits.item() == pytest.approx(expected_max, rel=1e-12)
    assert lse.item() == pytest.approx(expected_lse, rel=1e-12)


def test_tensor_scales_equal_float_scales():
    as_floats = reference([0, 2, 1], q_scale=0.75, kv_scale=1.5)
    as_tensors = reference([0, 2, 1], q_scale=torch.tensor([0.75]), kv_scale=torch.tensor(1.5))
    for got, expected in zip(as_tensors, as_floats, strict=True):
        assert torch.equal(got, expected)


def test_duplicated_index_counts_twice():
    out, max_logits, lse = reference([2, 0, 2], sm_scale=0.3)
    expected_out, expected_max, expected_lse = expected_softmax([2, 0, 2], 0.3)
    torch.testing.assert_close(out, expected_out, **TOL)
    assert max_logits.item() == pytest.approx(expected_max, rel=1e-12)
    assert lse.item() == pytest.approx(expected_lse, rel=1e-12)
    # Doubling the weight of slot 2: lse = log(2 e^l2 + e^l0).
    assert lse.item() == pytest.approx(math.log(2 * math.exp(7.5 * 0.3) + math.exp(4.0 * 0.3)), rel=1e-12)


def test_a_duplicated_maximum_at_huge_logits_weighs_its_row_once_in_total():
    """At logits of 2^60, lse = max + log 2 rounds to max in float64: the weights are still the softmax's
    (1/2 for each copy of the maximum), so out is exactly that value row."""
    out, max_logits, lse = reference([2, 0, 2], sm_scale=2.0**60)
    assert torch.equal(out, KV[2:3, :, :D_V].double())
    assert max_logits.item() == lse.item() == 7.5 * 2.0**60


@pytest.mark.parametrize(
    "invalid", [-1, -5, 3, INT32_MIN, INT32_MAX], ids=["-1", "-5", "s_kv", "int_min", "int_max"]
)
def test_invalid_index_is_ignored(invalid):
    with_invalid = reference([0, invalid, 2, invalid], sm_scale=0.3)
    without = reference([0, 2], sm_scale=0.3)
    for got, expected in zip(with_invalid, without, strict=True):
        assert torch.equal(got, expected)
    assert_sentinel_row(*reference([invalid, invalid]))


def test_sink_minus_inf_has_no_effect():
    plain = reference([0, 1, 2], sm_scale=0.3)
    with_sink = reference([0, 1, 2], sm_scale=0.3, attn_sink=torch.tensor([-math.inf]))
    for got, expected in zip(with_sink, plain, strict=True):
        assert torch.equal(got, expected)


def test_sink_plus_inf_zeroes_out_and_keeps_lse():
    plain_out, plain_max, plain_lse = reference([0, 1, 2], sm_scale=0.3)
    out, max_logits, lse = reference([0, 1, 2], sm_scale=0.3, attn_sink=torch.tensor([math.inf]))
    assert torch.equal(out, torch.zeros_like(plain_out))
    assert torch.equal(max_logits, plain_max)
    assert torch.equal(lse, plain_lse)


def test_finite_sink_scales_out_by_one_over_one_plus_exp_sink_minus_lse():
    plain_out, plain_max, plain_lse = reference([0, 1, 2], sm_scale=0.3)
    sink = 1.75
    out, max_logits, lse = reference([0, 1, 2], sm_scale=0.3, attn_sink=torch.tensor([sink]))
    factor = 1.0 / (1.0 + math.exp(sink - plain_lse.item()))
    torch.testing.assert_close(out, plain_out * factor, **TOL)
    assert torch.equal(max_logits, plain_max)
    assert torch.equal(lse, plain_lse)


@pytest.mark.parametrize("sink", [-math.inf, -2.0, 0.0, math.inf])
def test_topk_length_zero_gives_sentinels_with_or_without_sink(sink):
    assert_sentinel_row(*reference([0, 1, 2], topk_length=torch.tensor([0], dtype=torch.int32)))
    sinks = torch.tensor([sink])
    assert_sentinel_row(
        *reference([0, 1, 2], topk_length=torch.tensor([0], dtype=torch.int32), attn_sink=sinks)
    )


def test_topk_length_cuts_the_row():
    cut = reference([0, 2, 1], sm_scale=0.3, topk_length=torch.tensor([2], dtype=torch.int32))
    for got, expected in zip(cut, reference([0, 2], sm_scale=0.3), strict=True):
        assert torch.equal(got, expected)


def test_topk_length_outside_0_topk_acts_clamped():
    assert_sentinel_row(*reference([0, 1, 2], topk_length=torch.tensor([-3], dtype=torch.int32)))
    beyond = reference([0, 1, 2], sm_scale=0.3, topk_length=torch.tensor([7], dtype=torch.int32))
    for got, expected in zip(beyond, reference([0, 1, 2], sm_scale=0.3), strict=True):
        assert torch.equal(got, expected)


def test_topk_length_equal_to_topk_is_no_topk_length(make_inputs):
    args = make_inputs(s_q=5, h_q=3, s_kv=40, d_qk=8, topk=16, with_sink=True)
    args["d_v"] = 4
    full = torch.full((5,), 16, dtype=torch.int32)
    for got, expected in zip(
        sparse_mla_prefill_reference(**(args | {"topk_length": full})),
        sparse_mla_prefill_reference(**args),
        strict=True,
    ):
        assert torch.equal(got, expected)


def test_s_kv_below_topk_ignores_indices_past_s_kv(make_inputs):
    args = make_inputs(s_q=3, h_q=2, s_kv=3, d_qk=8, topk=8)
    args["d_v"] = 4
    args["indices"] = torch.arange(8, dtype=torch.int32).repeat(3, 1, 1)  # 0..7 with s_kv = 3
    first_three = args | {"indices": args["indices"][..., :3]}
    for got, expected in zip(
        sparse_mla_prefill_reference(**args), sparse_mla_prefill_reference(**first_three), strict=True
    ):
        assert torch.equal(got, expected)


def test_empty_kv_gives_sentinels_and_empty_query_gives_empty_outputs(make_inputs):
    args = make_inputs(s_q=3, h_q=2, s_kv=0, d_qk=8, topk=4, with_sink=True)
    out, max_logits, lse = sparse_mla_prefill_reference(**args | {"d_v": 4})
    for row in range(3):
        assert_sentinel_row(out, max_logits, lse, row)
    out, max_logits, lse = sparse_mla_prefill_reference(
        **make_inputs(s_q=0, h_q=2, s_kv=5, d_qk=8, topk=4) | {"d_v": 4}
    )
    assert (out.shape, max_logits.shape, lse.shape) == ((0, 2, 4), (0, 2), (0, 2))


def test_chunk_size_does_not_change_results(make_inputs):
    args = make_inputs(s_q=11, h_q=4, s_kv=50, d_qk=16, topk=24, with_sink=True, with_topk_length=True)
    args["d_v"] = 8
    whole = sparse_mla_prefill_reference(**args, chunk_rows=256)
    for chunk_rows in (1, 3, 11):
        for got, expected in zip(
            sparse_mla_prefill_reference(**args, chunk_rows=chunk_rows), whole, strict=True
        ):
            torch.testing.assert_close(got, expected, rtol=1e-14, atol=0.0)


def loop_reference(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length):
    """The semantics written out per row, head and slot, in Python floats."""
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    q, kv = q.double() * float(q_scale), kv[:, 0].double() * float(kv_scale)
    out = torch.zeros(s_q, h_q, d_v, dtype=torch.float64)
    max_logits = torch.full((s_q, h_q), -math.inf, dtype=torch.float64)
    lse = torch.full((s_q, h_q), math.inf, dtype=torch.float64)
    for i in range(s_q):
        length = topk if topk_length is None else int(topk_length[i])
        slots = [int(indices[i, 0, j]) for j in range(topk) if j < length and 0 <= indices[i, 0, j] < s_kv]
        if not slots:
            continue
        for h in range(h_q):
            logits = [float(q[i, h] @ kv[j]) * sm_scale for j in slots]
            top = max(logits)
            row_lse = top + math.log(sum(math.exp(logit - top) for logit in logits))
            sink = 1.0 if attn_sink is None else 1.0 / (1.0 + math.exp(float(attn_sink[h]) - row_lse))
            for logit, j in zip(logits, slots, strict=True):
                out[i, h] += math.exp(logit - row_lse) * sink * kv[j, :d_v]
            max_logits[i, h], lse[i, h] = top, row_lse
    return out, max_logits, lse


@pytest.mark.parametrize("with_sink", [False, True])
@pytest.mark.parametrize("with_topk_length", [False, True])
def test_matches_a_per_slot_loop_on_random_inputs(make_inputs, with_sink, with_topk_length):
    args = make_inputs(
        s_q=6,
        h_q=3,
        s_kv=20,
        d_qk=12,
        topk=10,
        invalid_fraction=0.3,
        with_sink=with_sink,
        with_topk_length=with_topk_length,
    )
    args["d_v"] = 8
    args["indices"][0, 0, :] = -1  # one row with no valid slot
    args["indices"][1, 0, 1::2] = args["indices"][1, 0, 0]  # and one with duplicates
    for got, expected in zip(sparse_mla_prefill_reference(**args), loop_reference(**args), strict=True):
        torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.gpu
def test_runs_on_the_gpu_like_on_the_cpu(make_inputs):
    args = make_inputs(s_q=300, h_q=64, s_kv=1000, d_qk=576, topk=256, with_sink=True, with_topk_length=True)
    on_cpu = sparse_mla_prefill_reference(**args)
    on_gpu = sparse_mla_prefill_reference(
        **{k: v.cuda() if torch.is_tensor(v) else v for k, v in args.items()}
    )
    for got, expected in zip(on_gpu, on_cpu, strict=True):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# quantize_q_rows: the kernel's per-row quantisation of a bfloat16 q
# ------------------------------------------------------------------------------------------------
BF16 = torch.bfloat16
E4M3_MAX = 448


def smallest_scale_exponent(amax: float) -> int:
    """The definition, in exact arithmetic: the smallest integer e in [-126, 127] with amax <= 448 * 2^e
    (0 for amax 0)."""
    if amax == 0:
        return 0
    exact = fractions.Fraction(amax)
    e = -126
    while e < 127 and exact > E4M3_MAX * fractions.Fraction(2) ** e:
        e += 1
    return e


def assert_quantised_by_definition(q: torch.Tensor) -> None:
    q_e4m3, row_scale = quantize_q_rows(q)
    assert q_e4m3.dtype == FP8 and q_e4m3.shape == q.shape
    assert row_scale.dtype == torch.float32 and row_scale.shape == q.shape[:-1]
    amax = q.float().abs().amax(dim=-1)
    for scale, row_amax in zip(row_scale.reshape(-1).tolist(), amax.reshape(-1).tolist(), strict=True):
        e = smallest_scale_exponent(row_amax)
        assert scale == 2.0**e, (row_amax, scale, e)
        if row_amax == 0:
            assert scale == 1.0
        elif e > -126:  # not clamped: amax in (224 * scale, 448 * scale]
            assert 224 * scale < row_amax <= 448 * scale, (row_amax, scale)
        else:
            assert row_amax <= 448 * scale
    scaled = q.double() / row_scale.double()[..., None]  # exact
    assert scaled.abs().max() <= E4M3_MAX
    # float32 holds the quotient exactly, but where it is far below e4m3's smallest subnormal (2^-9)
    normal = scaled.abs() >= 2.0**-126
    assert torch.equal(scaled.float().double()[normal], scaled[normal])
    # Rounded to nearest even into e4m3, once.
    assert torch.equal(q_e4m3.view(torch.uint8), scaled.to(FP8).view(torch.uint8))
    assert not torch.isnan(q_e4m3.float()).any()


def test_quantize_q_rows_hand_cases():
    q = torch.tensor(
        [
            [1.0, -3.0, 0.5, 0.0],  # amax 3 = 1.5 * 2^1: e = -7
            [448.0, -1.0, 0.0, 2.0],  # amax 448 = 1.75 * 2^8: e = 0, exactly 448
            [-456.0, 1.0, 0.0, 0.0],  # amax 456 > 448 (1.78 * 2^8): e = 1
            [0.0, -0.0, 0.0, 0.0],  # zero row: scale 1
            [1.75, 0.0, 0.0, 0.0],  # m = 1.75, E = 0: e = -8
            [1.765625, 0.0, 0.0, 0.0],  # m > 1.75: e = -7
        ]
    ).to(BF16)
    q_e4m3, row_scale = quantize_q_rows(q[None])
    assert row_scale[0].tolist() == [2.0**-7, 1.0, 2.0, 1.0, 2.0**-8, 2.0**-7]
    assert q_e4m3[0].float().tolist() == [
        [128.0, -384.0, 64.0, 0.0],
        [448.0, -1.0, 0.0, 2.0],
        [-224.0, 0.5, 0.0, 0.0],
        [0.0, -0.0, 0.0, 0.0],
        [448.0, 0.0, 0.0, 0.0],
        [224.0, 0.0, 0.0, 0.0],  # 1.765625 * 128 = 226, a tie between 224 and 232 (e4m3 step 8): even wins
    ]
    assert_quantised_by_definition(q[None])


@pytest.mark.parametrize("magnitude", [2.0**-60, 1e-3, 1.0, 37.0, 448.0, 1e5, 2.0**100])
def test_quantize_q_rows_matches_its_definition_on_random_rows(generator, magnitude):
    """Random rows over 13 orders of magnitude of row scales (one factor per row), some rows zero."""
    q = torch.randn(16, 8, 576, generator=generator) * magnitude
    q *= torch.exp2(torch.randint(-20, 21, (16, 8, 1), generator=generator).float())
    q[3, 5] = 0.0
    q[7, :, 100:] = 0.0
    assert_quantised_by_definition(q.to(BF16))


def test_quantize_q_rows_at_the_ends_of_the_exponent_range():
    """Subnormal and tiny amax (scale clamped to 2^-126), the largest bfloat16 values, a row whose amax is a
    power of two times 448 or 224, and a single non-zero element per row."""
    tiny = torch.finfo(BF16).tiny  # 2^-126, the smallest normal bfloat16
    rows = [
        [2.0**-133, 0.0, -(2.0**-133)],  # the smallest subnormal bfloat16
        [3 * 2.0**-130, 2.0**-131, 0.0],  # subnormal amax
        [tiny, -tiny / 2, 0.0],
        [448 * 2.0**-126, 1.0 * 2.0**-126, 0.0],  # exactly 448 * 2^-126: e = -126
        [449 * 2.0**-126, 0.0, 0.0],  # bfloat16 rounds it to 448 * 2^-126
        [456 * 2.0**-126, 0.0, 0.0],  # just above: e = -125
        [torch.finfo(BF16).max, -1.0, 0.0],  # amax about 1.99 * 2^127: e = 120
        [-torch.finfo(BF16).max, 2.0**-100, 0.0],
        [448 * 2.0**20, 224 * 2.0**20, 0.0],
        [224 * 2.0**-3, 0.0, 0.0],  # 224 * 2^-3 = 1.75 * 2^4: e = -4, q / scale = 448
        [1.0, 0.0, 0.0],
    ]
    q = torch.tensor(rows, dtype=torch.float64).to(BF16)
    assert_quantised_by_definition(q)
    _, row_scale = quantize_q_rows(q)
    assert row_scale[:4].tolist() == [2.0**-126] * 4
    assert row_scale[5].item() == 2.0**-125 and row_scale[6].item() == 2.0**120
    assert row_scale[9].item() == 2.0**-4


def test_quantize_q_rows_is_the_same_on_any_leading_shape(generator):
    q = (torch.randn(5, 3, 512, generator=generator) * 9).to(BF16)
    flat_e4m3, flat_scale = quantize_q_rows(q.reshape(15, 512))
    q_e4m3, row_scale = quantize_q_rows(q)
    assert torch.equal(q_e4m3.reshape(15, 512).view(torch.uint8), flat_e4m3.view(torch.uint8))
    assert torch.equal(row_scale.reshape(15), flat_scale)


def test_bf16_q_reference_is_the_reference_on_the_quantised_rows(make_inputs):
    """``q_scale=None`` with a bfloat16 q: the rows quantised by ``quantize_q_rows``, each with its own scale
    in q_scale's place (the per-slot loop, row by row); ``q_scale=1.0``: the exact product of the bfloat16
    q."""
    args = make_inputs(
        s_q=5, h_q=4, s_kv=30, d_qk=16, topk=12, with_sink=True, with_topk_length=True, q_dtype=BF16
    )
    args["d_v"] = 8
    args["q"] = args["q"] * torch.tensor([2.0**-8, 1.0, 3.0, 2.0**8]).to(BF16)[None, :, None]
    got = sparse_mla_prefill_reference(**args)
    q_e4m3, row_scale = quantize_q_rows(args["q"])
    assert torch.equal(
        sparse_mla_prefill_reference(**args | {"q": q_e4m3, "q_scale": row_scale})[2], got[2]
    )  # a [s_q, h_q] q_scale: the same call
    for h in range(4):
        for i in range(5):
            row = {
                **args,
                "q": q_e4m3[i : i + 1, h : h + 1],
                "indices": args["indices"][i : i + 1],
                "topk_length": args["topk_length"][i : i + 1],
                "attn_sink": args["attn_sink"][h : h + 1],
                "q_scale": row_scale[i, h].item(),
            }
            for a, b in zip(got, loop_reference(**row), strict=True):
                torch.testing.assert_close(a[i : i + 1, h : h + 1], b, **TOL)
    exact = sparse_mla_prefill_reference(**args | {"q_scale": 1.0})
    expected = loop_reference(**args | {"q_scale": 1.0})
    for a, b in zip(exact, expected, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert not torch.equal(exact[2], got[2])  # the quantisation is visible


def test_q_scale_none_needs_a_bf16_q_and_a_row_scale_needs_the_rows_shape(make_inputs):
    args = make_inputs(s_q=3, h_q=2, s_kv=10, d_qk=8, topk=4) | {"d_v": 4}
    with pytest.raises(ValueError, match="q_scale: None only for a bfloat16 q"):
        sparse_mla_prefill_reference(**args | {"q_scale": None})
    with pytest.raises(
        ValueError, match=r"q_scale: expected one element or shape \[s_q, h_q\], got \[2, 3\]"
    ):
        sparse_mla_prefill_reference(**args | {"q_scale": torch.ones(2, 3)})


@pytest.mark.gpu
def test_quantize_q_rows_on_the_gpu_is_bitwise_the_cpus(generator):
    q = torch.randn(64, 32, 576, generator=generator) * torch.exp2(
        torch.randint(-140, 120, (64, 32, 1)).float()
    )
    q[0, 0] = 0.0
    q = q.to(BF16)
    on_cpu = quantize_q_rows(q)
    on_gpu = quantize_q_rows(q.cuda())
    assert torch.equal(on_gpu[0].cpu().view(torch.uint8), on_cpu[0].view(torch.uint8))
    assert torch.equal(on_gpu[1].cpu(), on_cpu[1])
