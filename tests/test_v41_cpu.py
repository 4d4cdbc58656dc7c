"""DeepSeek V4.1's paged caches on CPU: the layouts' offsets, the test quantiser's round trip against the
float64 values it quantised, the exact dequantisation against the byte-by-byte decoder, the float64 paged
reference's one softmax over a main and an extra cache against a direct float64 computation, the FP4 tokens
gathered as V4.1 records (read back as a V4.1 cache: within half an e4m3 step of the exact values, exact
for power-of-two FP4 scales, each group's scale the least that holds it), and the checks that name what is
wrong (the gather's, and the direct paged read's refusal of V4.1 caches).

Round-trip bounds, per value x with its group's scale s: V4.1 (e4m3, power-of-two s) |x - x'| <=
max(2^-4 |x|, 2^-10 s) (half an e4m3 step; 2^-10 below e4m3's normal range); V4.1 FP4 (e2m1, e4m3 s)
|x - x'| <= max(|x| / 4, s / 4) where s is a normal e4m3 value (half an e2m1 step, saturation at 6
included: x / s <= 6 / (1 - 2^-4)); a subnormal s (max |x| < 6 * 2^-6) may be rounded down further, and
its group saturates more.
"""

import math

import pytest
import torch
from paged_cache import (
    decode_token_f64,
    empty_cache,
    fill_random,
    pow2_fp4_scales,
    quantize_v41,
    quantized_cache,
    write_token,
)

from q8kv8 import contract, gather_dequant_requant_fp8_paged, kv_layout, sparse_mla_q8kv8_paged_fwd
from q8kv8.reference import dequantize_paged_cache, gather_dequant_paged_reference, sparse_mla_paged_reference

E4M3 = torch.float8_e4m3fn


def test_layout_offsets():
    v41, fp4 = kv_layout.V41, kv_layout.V41_FP4
    assert kv_layout.get_layout("v41") is v41 and kv_layout.get_layout("v41_fp4") is fp4
    assert (v41.d_qk, v41.bytes_per_token, v41.token_bytes, v41.value_bytes) == (512, 528, 528, 512)
    assert (v41.scale_offset, v41.num_scales, v41.scale_group, v41.scale_type) == (512, 16, 32, "ue8m0")
    assert (fp4.d_qk, fp4.bytes_per_token, fp4.token_bytes, fp4.value_bytes) == (512, 288, 288, 256)
    assert (fp4.scale_offset, fp4.num_scales, fp4.scale_group, fp4.scale_type) == (256, 32, 16, "e4m3")
    for layout in (v41, fp4):  # values, then their scales: the whole record
        assert (
            layout.d_rope == 0
            and layout.value_bytes + layout.num_scales * layout.scale_bytes == layout.token_bytes
        )
        assert layout.padded_page_bytes(64) == layout.min_page_bytes(64) == 64 * layout.bytes_per_token
        assert kv_layout.LAYOUT_BY_BYTES_PER_TOKEN[layout.bytes_per_token] is layout
    assert v41 in kv_layout.PAGED_ATTENTION_LAYOUTS and fp4 not in kv_layout.PAGED_ATTENTION_LAYOUTS


def test_dequantized_rows_are_the_decoded_tokens(generator):
    """Random bytes (every e2m1 code, e4m3 values without NaN patterns, UE8M0 bytes 100..159, positive e4m3
    scales): the reference's exact dequantisation is the independent decoder's, token by token."""
    for layout in ("v41", "v41_fp4"):
        cache = empty_cache(layout, 3, 16, extra_page_bytes=32)
        fill_random(cache, 16, layout, generator, scale_bytes=(100, 160))
        rows = dequantize_paged_cache(cache)[:, 0]
        expected = torch.tensor(
            [decode_token_f64(cache, s, 16, layout) for s in range(48)], dtype=torch.float64
        )
        assert rows.shape == (48, 512) and torch.equal(rows, expected)


def _round_trip(layout: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` [n, 512] quantised into a one-page cache and dequantised exactly (float64)."""
    cache = empty_cache(layout, 1, x.shape[0])
    values, scales = quantize_v41(x, layout)
    for slot in range(x.shape[0]):
        write_token(cache, slot, x.shape[0], layout, values[slot], scales[slot], None)
    return dequantize_paged_cache(cache)[:, 0]


def test_round_trip_v41(generator):
    """Groups of 32 whose magnitudes range over 2^-20 to 2^12 (and an all-zero one): every value within
    half an e4m3 step of its scale, every scale the smallest power of two >= max |x| / 448 (or 2^-13)."""
    group_std = torch.exp2(torch.randint(-20, 13, (64, 16, 1), generator=generator).float())
    x = (torch.randn(64, 16, 32, generator=generator) * group_std).view(64, 512)
    x[3, 64:96] = 0
    got = _round_trip("v41", x)
    scale = torch.exp2(
        torch.ceil(torch.log2((x.double().view(64, 16, 32).abs().amax(2) / 448).clamp_min(1e-4)))
    )
    scale = scale.repeat_interleave(32, dim=1)
    bound = torch.maximum(x.double().abs() * 2**-4, scale * 2**-10)
    assert ((got - x.double()).abs() <= bound).all()
    assert (got[3, 64:96] == 0).all()
    rel = ((got - x.double()).norm() / x.double().norm()).item()
    assert rel < 2**-5, rel  # e4m3's 3 mantissa bits: ~2^-6 rms on normal values


def test_round_trip_v41_fp4(generator):
    """Groups of 16 over 2^-12 to 2^8 (and an all-zero one): every scale max |x| / 6 rounded to nearest
    into e4m3, every value within half an e2m1 step of its scale where the scale is normal, and at most 6
    scales in magnitude everywhere."""
    group_std = torch.exp2(torch.randint(-12, 9, (64, 32, 1), generator=generator).float())
    x = (torch.randn(64, 32, 16, generator=generator) * group_std).view(64, 512)
    x[5, :16] = 0
    got = _round_trip("v41_fp4", x)
    amax = x.double().view(64, 32, 16).abs().amax(2)
    scale = (amax / 6).clamp(2.0**-9, 448).float().to(E4M3).double().repeat_interleave(16, dim=1)
    bound = torch.maximum(x.double().abs() / 4, scale / 4)
    normal = scale >= 2.0**-6
    assert normal.float().mean() > 0.5 and not normal.all()
    assert ((got - x.double()).abs() <= bound)[normal].all()
    assert (got.abs() <= 6 * scale).all()
    assert (got[5, :16] == 0).all()
    rel = ((got - x.double()).norm() / x.double().norm()).item()
    assert rel < 0.15, rel  # e2m1's one mantissa bit


def test_fp4_rounds_to_nearest_ties_to_even_and_saturates():
    """A group whose largest magnitude is 6 (scale exactly 1): the midpoints go to the even code, values
    above 6 cannot occur at scale max/6 but a scale rounded down saturates them; the nibble order."""
    x = torch.zeros(1, 512)
    x[0, :16] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -5, 0.3, 2.9, -6, 0.5, 1])
    got = _round_trip("v41_fp4", x)[0, :16]
    want = [6, 0, 1, 1, 2, 2, 4, 4, 0, -1, -4, 0.5, 3, -6, 0.5, 1]
    assert got.tolist() == want
    values, scales = quantize_v41(x, "v41_fp4")
    assert values[0, 0].item() == 0x07 | (0x00 << 4)  # 6 in the low nibble, 0 (0.25 rounded) in the high
    assert scales[0, 0].view(E4M3).item() == 1.0
    y = torch.zeros(1, 512)
    y[0, :16] = 6.2  # scale e4m3(6.2 / 6) = 1: 6.2 saturates to 6
    assert (_round_trip("v41_fp4", y)[0, :16] == 6).all()


def _direct_attention(q, rows, sm_scale, sink):
    """Float64 attention of one query's heads over ``rows`` [n, 512] (n >= 1): out, max_logits, lse."""
    logits = q @ rows.T * sm_scale  # [h, n]
    lse = torch.logsumexp(logits, dim=1)
    out = torch.softmax(logits, dim=1) @ rows
    if sink is not None:
        out = out * (torch.exp(lse) / (torch.exp(lse) + torch.exp(sink)))[:, None]
    return out, logits.amax(dim=1), lse


@pytest.mark.parametrize("with_sink", [False, True])
def test_one_softmax_over_the_main_and_the_extra_cache(generator, with_sink):
    """``sparse_mla_paged_reference`` with an extra cache against attention computed query by query from
    the decoder's rows: the main cache's slots before ``topk_length`` and the extra cache's before
    ``extra_topk_length`` (invalid ones skipped) in one softmax, the sink over both."""
    s_q, h, topk, extra_topk, page_size = 7, 4, 24, 16, 16
    main = quantized_cache("v41", 3, page_size, generator, pow2_scales=True, extra_page_bytes=0)
    extra = quantized_cache("v41_fp4", 2, page_size, generator, pow2_scales=True, extra_page_bytes=32)
    indices = torch.randint(-4, 3 * page_size + 4, (s_q, 1, topk), generator=generator, dtype=torch.int32)
    extra_indices = torch.randint(-4, 2 * page_size + 4, (s_q, 1, extra_topk), generator=generator)
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    extra_topk_length = torch.randint(0, extra_topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    topk_length[0], extra_topk_length[0] = 0, 0  # no valid slot at all
    topk_length[1] = 0  # the extra cache's only
    q = torch.randn(s_q, h, 512, generator=generator, dtype=torch.float64)
    sink = torch.randn(h, generator=generator, dtype=torch.float64) if with_sink else None
    got = sparse_mla_paged_reference(
        q, main, indices, 0.05, 1.0, 512, sink, topk_length,
        extra_cache=extra, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
    )  # fmt: skip
    for i in range(s_q):
        rows = [
            decode_token_f64(cache, slot, page_size, layout)
            for cache, layout, slots, count, pages in (
                (main, "v41", indices, topk_length, 3),
                (extra, "v41_fp4", extra_indices, extra_topk_length, 2),
            )
            for slot in slots[i, 0, : count[i]].tolist()
            if 0 <= slot < pages * page_size
        ]
        if not rows:
            assert (got[0][i] == 0).all() and (got[1][i] == -math.inf).all() and (got[2][i] == math.inf).all()
            continue
        want = _direct_attention(q[i], torch.tensor(rows, dtype=torch.float64), 0.05, sink)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a[i], b, rtol=1e-12, atol=1e-12)
    assert not torch.isfinite(got[2][0]).any()


def test_reference_checks_the_extra_arguments(generator):
    main = quantized_cache("v41", 1, 16, generator, pow2_scales=True)
    call = {"q": torch.randn(2, 4, 512, dtype=torch.float64), "cache": main, "sm_scale": 0.05, "q_scale": 1.0}
    call["indices"] = torch.zeros(2, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="extra_indices: expected the extra cache's slots"):
        sparse_mla_paged_reference(**call, extra_cache=main)
    with pytest.raises(ValueError, match="expected None without an extra_cache"):
        sparse_mla_paged_reference(**call, extra_indices=call["indices"])
    v32 = quantized_cache("v32", 1, 16, generator, pow2_scales=True)
    with pytest.raises(ValueError, match="extra_cache: expected d_qk 512"):
        sparse_mla_paged_reference(**call, extra_cache=v32, extra_indices=call["indices"])


def _zeros(*shape, dtype=torch.uint8):
    return torch.zeros(*shape, dtype=dtype)


@pytest.mark.parametrize(
    ("layout", "overrides", "error", "match"),
    [
        ("v41", {"cache_u8": _zeros(2, 64 * 528 - 16)}, ValueError, "pages of at least 33792"),
        ("v41_fp4", {"cache_u8": _zeros(2, 64 * 288 - 1)}, ValueError, "pages of at least 18432"),
        ("v41", {"cache_u8": _zeros(2, 64 * 528, dtype=torch.int8)}, TypeError, "expected dtype torch.uint8"),
        ("v41", {"out": _zeros(10, 1, 576, dtype=E4M3)}, ValueError, r"out: expected shape \[10, 1, 512\]"),
        ("v41_fp4", {"out": _zeros(10, 1, 512, dtype=torch.bfloat16)}, TypeError, "out: expected dtype"),
        ("v41_fp4", {}, ValueError, "cache: expected a CUDA tensor, got device cpu"),
    ],
)
def test_gather_argument_errors(layout, overrides, error, match):
    args = {
        "cache_u8": empty_cache(layout, 2, 64),
        "slot_ids": torch.arange(10, dtype=torch.int32),
        "page_size": 64,
        "layout": layout,
    }
    with pytest.raises(error, match=match):
        gather_dequant_requant_fp8_paged(**args | overrides)


@pytest.mark.parametrize("layout", ["v41_fp4"])
def test_the_direct_paged_read_names_the_workspace_path(generator, monkeypatch, layout):
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    cache = quantized_cache(layout, 2, 16, generator, pow2_scales=True)
    q = torch.randn(3, 64, 512, generator=generator).to(torch.bfloat16)
    indices = torch.zeros(3, 1, 128, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"a {layout} cache .* is not read directly; gather its rows"):
        sparse_mla_q8kv8_paged_fwd(q, cache, indices, 0.05, None)


def test_fp4_tokens_as_v41_records(generator):
    """The gather's V4.1 records of FP4 tokens, read back as a V4.1 cache (one token a page): each value
    within half an e4m3 step (2^-4 relative) of the exact FP4 value, exact for power-of-two FP4 scales; each
    group's UE8M0 scale the least 2^E with 6 * (its larger block scale) <= 448 * 2^E, so a cache of small
    values keeps its precision (e4m3 rows at scale 1 would flush it); invalid slots and the extra rows zero
    with scales 2^0."""
    for pow2, std in ((False, 1.0), (True, 1.0), (False, 1e-4)):
        cache = quantized_cache("v41_fp4", 4, 16, generator, pow2_scales=True, std=std)
        if pow2:
            cache = pow2_fp4_scales(cache, generator)
        slots = torch.tensor([0, 5, 63, -1, 64, 17, 40], dtype=torch.int32)
        records = gather_dequant_paged_reference(cache, slots, 16, "v41_fp4", torch.uint8, extra_rows=2)
        assert records.shape == (9, 528) and records.dtype == torch.uint8
        valid = (slots >= 0) & (slots < 64)
        read = dequantize_paged_cache(records.view(-1, 1, 1, 528))[:, 0]
        exact = dequantize_paged_cache(cache, slots[valid])[:, 0]
        error = (read[:7][valid] - exact).abs()
        assert (error <= exact.abs() * 2**-4).all(), (pow2, std)
        assert not pow2 or torch.equal(read[:7][valid], exact)
        assert (read[:7][~valid] == 0).all() and (read[7:] == 0).all()
        assert (records[~torch.cat([valid, torch.tensor([False, False])]), 512:] == 127).all()
        token = slots[valid].long()
        block_scales = cache[token // 16, token % 16, 0, 256:].contiguous().view(E4M3).double()
        bound = 6 * block_scales.view(-1, 16, 2).amax(dim=2)
        exponent = records[:7][valid, 512:].double() - 127
        assert ((bound <= 448 * 2**exponent) & (bound > 448 * 2 ** (exponent - 1))).all(), (pow2, std)
