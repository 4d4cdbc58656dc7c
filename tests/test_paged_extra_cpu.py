"""``sparse_mla_q8kv8_paged_fwd`` with an extra cache (``q8kv8.paged_extra``) on CPU: the whole composition
(an extra cache of the main layout joined into the main launch; else main part, extra part read directly or
gathered, the merge by lse, the sink once; the buffers) against the float64 reference over both caches
(``sparse_mla_paged_reference(..., extra_cache=...)``), and the extra arguments' errors.

The device checks are patched to accept CPU tensors; the attention launch is a stand-in writing the float64
reference of what it is given (a cache's byte view, read as the kernel reads it with an extra cache, or
gathered e4m3 rows), the gather launch the bit-exact gather reference. The FP4 caches get power-of-two e4m3
scales, so their rows gathered to e4m3 are exact and the composition's own rounding is all that differs from
the reference: each part's out rounded to bf16, the merge in float32, the merged out rounded to bf16
(``||out - ref|| / ||ref|| <= 2^-8``); max_logits a part's float32 max (relative 2^-23), lse the float32
log-sum-exp of the parts' (relative 1e-6, absolute below 1).
"""

import math

import pytest
import torch
from paged_cache import pow2_fp4_scales, quantized_cache

from q8kv8 import contract, paged_gather, sparse_mla_q8kv8_paged_fwd
from q8kv8.contract import InputTypeError
from q8kv8.metadata import LOGITS_IN_FLOAT32, PRECISIONS
from q8kv8.reference import (
    dequantize_paged_cache,
    gather_dequant_paged_reference,
    sparse_mla_paged_reference,
    sparse_mla_prefill_reference,
)

S_Q, H_Q, PAGE_SIZE = 7, 16, 16
D_QK = {"v32": 576, "model1": 512, "v41": 512, "v41_fp4": 512}
PAIRS = [("v41", "v41_fp4"), ("v41", "v41"), ("model1", "model1"), ("v32", "v32")]
OUT_TOLERANCE, MAX_TOLERANCE, LSE_TOLERANCE = 2**-8, 2**-23, 1e-6


@pytest.fixture
def launches(monkeypatch, fake_kernels) -> list[str]:
    """Accept CPU tensors; the attention launch writes the float64 reference of the rows it is given, the
    gather launch the gather reference; returns what was launched ("paged v41", "paged v41 + extra", "rows",
    "gather v41_fp4")."""
    recorded = []
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    monkeypatch.setattr(paged_gather, "_check_devices", lambda *tensors: None)

    def attention(q, kv, indices, topk_length, attn_sink, q_scale, kv_scale, sm_scale, out, max_logits, lse,
                  *_schedule, cache=None, extra_cache=None, extra_from=None):  # fmt: skip
        recorded.append(
            "rows" if cache is None else f"paged {cache}" + (" + extra" if extra_cache is not None else "")
        )
        if cache is not None:
            kv = dequantized_rows(kv)
        if extra_cache is not None:  # index slots from extra_from on are the extra cache's token slots
            extra_rows = dequantized_rows(extra_cache)
            main, extra = indices[..., :extra_from], indices[..., extra_from:]
            main = torch.where(main < kv.shape[0], main, -1)
            extra = torch.where((extra >= 0) & (extra < extra_rows.shape[0]), extra + kv.shape[0], -1)
            kv, indices = torch.cat((kv, extra_rows)), torch.cat((main, extra), dim=-1)
        reference = sparse_mla_prefill_reference(
            q, kv, indices, sm_scale, q_scale, kv_scale, 512, attn_sink, topk_length
        )
        for buffer, values in zip((out, max_logits, lse), reference, strict=True):
            buffer.copy_(values)

    def gather(pages, words, out, page_size, layout, rows=None):
        recorded.append(f"gather {layout}")
        out.copy_(gather_dequant_paged_reference(pages, words[:, 0], page_size, layout, out.dtype))
        if rows is not None:  # V4.1 records: each slot's record, -1 for a slot outside the cache
            slots = words[:, 0]
            valid = (slots >= 0) & (slots < pages.shape[0] * page_size)
            rows.copy_(torch.where(valid, torch.arange(slots.shape[0], dtype=torch.int32), -1))

    module = fake_kernels(attention)
    module.launch_paged_kv_gather = gather
    return recorded


def dequantized_rows(view):
    """A cache's [num_pages, page_size, bytes_per_token] byte view (what the kernel reads) as float64 rows."""
    return dequantize_paged_cache(
        view.as_strided((*view.shape[:2], 1, view.shape[2]), (*view.stride()[:2], 1, 1))
    )


def make_cache(layout, pages, generator):
    cache = quantized_cache(layout, pages, PAGE_SIZE, generator, pow2_scales=True)
    return pow2_fp4_scales(cache, generator) if layout == "v41_fp4" else cache


def extra_call(generator, main="v41", extra="v41_fp4", q_dtype=torch.bfloat16, topk=256, extra_topk=128):
    """Keyword arguments of one call: slots uniform over each cache and a few past either end, lengths
    random but for a query with no valid slot in either part, one with the main part's only and one with the
    extra part's only; a sink."""
    pages, extra_pages = 6, 4
    s_main, s_extra = pages * PAGE_SIZE, extra_pages * PAGE_SIZE
    topk_length = torch.randint(0, topk + 1, (S_Q,), generator=generator, dtype=torch.int32)
    extra_topk_length = torch.randint(0, extra_topk + 1, (S_Q,), generator=generator, dtype=torch.int32)
    topk_length[0], extra_topk_length[0] = 0, 0
    topk_length[1], extra_topk_length[2] = 0, 0
    q = torch.randn(S_Q, H_Q, D_QK[main], generator=generator)
    call = {
        "q": q.to(q_dtype),
        "cache": make_cache(main, pages, generator),
        "indices": torch.randint(-3, s_main + 3, (S_Q, 1, topk), generator=generator, dtype=torch.int32),
        "sm_scale": D_QK[main] ** -0.5,
        "q_scale": torch.tensor([0.75]) if q_dtype == torch.float8_e4m3fn else None,
        "attn_sink": torch.randn(H_Q, generator=generator),
        "topk_length": topk_length,
        "extra_cache": make_cache(extra, extra_pages, generator),
        "extra_indices": torch.randint(
            -3, s_extra + 3, (S_Q, 1, extra_topk), generator=generator, dtype=torch.int32
        ),
        "extra_topk_length": extra_topk_length,
    }
    return call


def assert_matches(outputs, call):
    """Against the float64 reference over both caches, with the module's tolerances; rows with no valid
    slot in either part (query 0's among them) exactly out 0, max_logits -inf, lse +inf. Returns which."""
    out, max_logits, lse = outputs
    ref_out, ref_max, ref_lse = sparse_mla_paged_reference(**call)
    empty = ref_lse == math.inf
    assert empty[0].all()
    assert (
        (out[empty] == 0).all() and (max_logits[empty] == -math.inf).all() and (lse[empty] == math.inf).all()
    )
    assert ((out.double() - ref_out).norm() / ref_out.norm()).item() <= OUT_TOLERANCE
    torch.testing.assert_close(max_logits.double(), ref_max, rtol=MAX_TOLERANCE, atol=1e-6)
    torch.testing.assert_close(lse[~empty].double(), ref_lse[~empty], rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE)
    return empty


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("main, extra", PAIRS)
def test_matches_the_float64_reference_over_both_caches(generator, launches, main, extra, q_dtype):
    call = extra_call(generator, main, extra, q_dtype)
    outputs = sparse_mla_q8kv8_paged_fwd(**call)
    assert not assert_matches(outputs, call)[1:].any()  # queries 1 and 2: one part's slots only
    if extra == "v41_fp4":  # gathered into V4.1 records, read in the same launch
        assert launches == ["gather v41_fp4", f"paged {main} + extra"]
    else:  # the main layout's: read in the same launch
        assert launches == [f"paged {main} + extra"]


@pytest.mark.parametrize("extra", ["v41", "v41_fp4"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_merged_parts_sum_their_logits_in_float32(generator, launches, monkeypatch, extra, precision):
    """Two parts merged by their lse (an extra cache the main launch does not read: V4.1's beside a V4 main
    cache, read by its own paged call or gathered into e4m3 rows) each run the precision with S summed in
    float32 (``LOGITS_IN_FLOAT32``: their lse weighs the merge); the sink is applied once, after."""
    import q8kv8

    precisions = []
    launch = q8kv8.kernels.launch_sparse_prefill

    def recording(*args, **kwargs):
        precisions.append(args[11])  # launch_sparse_prefill's precision
        return launch(*args, **kwargs)

    monkeypatch.setattr(q8kv8.kernels, "launch_sparse_prefill", recording)
    call = extra_call(generator, main="model1", extra=extra)
    assert_matches(sparse_mla_q8kv8_paged_fwd(**call, precision=precision), call)
    assert launches == (
        ["paged model1", "paged v41"] if extra == "v41" else ["paged model1", "gather v41_fp4", "rows"]
    )
    assert precisions == [LOGITS_IN_FLOAT32[precision]] * 2


def test_without_a_sink_or_lengths(generator, launches):
    call = extra_call(generator) | {"attn_sink": None, "topk_length": None, "extra_topk_length": None}
    call["indices"][0], call["extra_indices"][0] = -1, -1  # still a query with no valid slot
    assert_matches(sparse_mla_q8kv8_paged_fwd(**call), call)


def test_buffers_are_written_and_returned(generator, launches):
    call = extra_call(generator, extra_topk=256)
    buffers = {
        "out": torch.full((S_Q, H_Q, 512), math.nan, dtype=torch.bfloat16),
        "max_logits": torch.full((S_Q, H_Q), math.nan),
        "lse": torch.full((S_Q, H_Q), math.nan),
    }
    outputs = sparse_mla_q8kv8_paged_fwd(**call, **buffers)
    assert all(got is buffer for got, buffer in zip(outputs, buffers.values(), strict=True))
    assert_matches(outputs, call)
    assert all(torch.equal(a, b) for a, b in zip(outputs, sparse_mla_q8kv8_paged_fwd(**call), strict=True))


@pytest.mark.parametrize("extra", ["v41_fp4", "v41"])
def test_empty_calls_and_an_empty_extra_cache(generator, launches, extra):
    call = extra_call(generator, extra=extra)
    empty = {"q": call["q"][:0], "indices": call["indices"][:0], "topk_length": call["topk_length"][:0]}
    empty |= {"extra_indices": call["extra_indices"][:0], "extra_topk_length": call["extra_topk_length"][:0]}
    assert [t.shape[0] for t in sparse_mla_q8kv8_paged_fwd(**call | empty)] == [0, 0, 0]
    no_pages = call | {"extra_cache": call["extra_cache"][:0]}
    outputs = sparse_mla_q8kv8_paged_fwd(**no_pages)
    single = {name: value for name, value in call.items() if not name.startswith("extra_")}
    assert_matches(
        outputs, no_pages | {"extra_cache": None, "extra_indices": None, "extra_topk_length": None}
    )
    main_only = sparse_mla_q8kv8_paged_fwd(**single)
    # the sink applied before or after out's rounding to bf16: one bf16 step apart at most
    torch.testing.assert_close(outputs[0].double(), main_only[0].double(), rtol=2**-7, atol=1e-6)
    assert torch.equal(outputs[1], main_only[1])


def overlapping_max_logits(call):
    """A max_logits buffer inside the extra cache's bytes."""
    return call["extra_cache"]._base.view(-1)[64 : 64 + S_Q * H_Q * 4].view(torch.float32).view(S_Q, H_Q)


@pytest.mark.parametrize(
    "change, error, message",
    [
        (
            lambda c: c | {"extra_cache": None, "extra_topk_length": None},
            ValueError,
            "extra_indices: expected None without an extra_cache",
        ),
        (
            lambda c: c | {"extra_cache": None, "extra_indices": None},
            ValueError,
            "extra_topk_length: expected None without an extra_cache",
        ),
        (
            lambda c: c | {"extra_indices": None},
            ValueError,
            "extra_indices: expected the extra cache's token",
        ),
        (
            lambda c: c | {"extra_cache": c["extra_cache"].float()},
            InputTypeError,
            "extra_cache: expected dtype torch.uint8",
        ),
        (
            lambda c: c | {"extra_cache": c["extra_cache"][..., :200]},
            ValueError,
            r"extra_cache: expected shape \[num_pages, page_size, 1, bytes_per_token\]",
        ),
        (
            lambda c: c | {"extra_cache": c["extra_cache"][:, :12]},
            ValueError,
            r"extra_cache: expected page_size = extra_cache.shape\[1\] a power of two",
        ),
        (
            lambda c: c | {"extra_indices": c["extra_indices"].long()},
            InputTypeError,
            "extra_indices: expected dtype torch.int32",
        ),
        (
            lambda c: c | {"extra_indices": c["extra_indices"][:, 0]},
            ValueError,
            r"extra_indices: expected shape \[s_q, 1, extra_topk\] with s_q = 7",
        ),
        (
            lambda c: c | {"extra_indices": c["extra_indices"][1:]},
            ValueError,
            r"extra_indices: expected shape \[s_q, 1, extra_topk\] with s_q = 7",
        ),
        (
            lambda c: c | {"extra_indices": c["extra_indices"][..., :100]},
            ValueError,
            "extra_indices: expected extra_topk = extra_indices.shape\\[2\\] a positive multiple of 128",
        ),
        (
            lambda c: c | {"extra_indices": c["extra_indices"].repeat(1, 1, 2)[..., ::2]},
            ValueError,
            "extra_indices: expected a contiguous last dimension",
        ),
        (
            lambda c: c | {"extra_topk_length": c["extra_topk_length"].float()},
            InputTypeError,
            "extra_topk_length: expected dtype torch.int32",
        ),
        (
            lambda c: c | {"extra_topk_length": c["extra_topk_length"][1:]},
            ValueError,
            r"extra_topk_length: expected shape \[s_q\] = \[7\]",
        ),
        (
            lambda c: c | {"extra_indices": c["extra_indices"].to("meta")},
            ValueError,
            r"extra_indices: expected a tensor on cpu \(the device of q\), got device meta",
        ),
        (
            lambda c: c | {"max_logits": overlapping_max_logits(c)},
            ValueError,
            "max_logits: expected memory of its own, got memory overlapping extra_cache",
        ),
        # the main call is checked first
        (
            lambda c: c | {"precision": "exact", "extra_indices": None},
            ValueError,
            "precision: expected one of",
        ),
    ],
)
def test_extra_argument_errors_name_the_argument(generator, launches, change, error, message):
    with pytest.raises(error, match=message):
        sparse_mla_q8kv8_paged_fwd(**change(extra_call(generator)))
    assert not launches


def test_extra_cache_of_another_d_qk(generator, launches):
    call = extra_call(generator, "v32", "v32")
    v41 = make_cache("v41", 2, generator)
    with pytest.raises(ValueError, match="extra_cache: a v41 cache holds d_qk 512, got q with d_qk 576"):
        sparse_mla_q8kv8_paged_fwd(**call | {"extra_cache": v41})
    assert not launches


def test_check_ranges_names_extra_topk_length(generator, launches, monkeypatch):
    monkeypatch.setenv("Q8KV8_CHECK_RANGES", "1")
    call = extra_call(generator)
    call["extra_topk_length"][3] = 129
    with pytest.raises(ValueError, match=r"extra_topk_length: expected values in \[0, 128\]"):
        sparse_mla_q8kv8_paged_fwd(**call)
    assert not launches


@pytest.mark.parametrize("extra", ["v41_fp4", "v41"])
def test_compiled_call_matches_eager(generator, launches, extra):
    """Under ``torch.compile(fullgraph=True)`` the call is the parts' custom ops (the gather's included) and
    the merge's torch operations (the eager call reads the extra cache in the main launch, the FP4 one
    gathered into V4.1 records): the eager call's max_logits, the reference's out and lse as the eager
    call's."""
    call = extra_call(generator, extra=extra)
    expected = sparse_mla_q8kv8_paged_fwd(**call)
    torch._dynamo.reset()
    try:
        got = torch.compile(lambda arguments: sparse_mla_q8kv8_paged_fwd(**arguments), fullgraph=True)(call)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got[1], expected[1])
    assert_matches(got, call)
    assert launches.count("gather v41_fp4") == (2 if extra == "v41_fp4" else 0)
    assert launches.count("paged v41 + extra") == 1  # the eager call's
