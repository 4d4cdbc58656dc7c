"""``sparse_mla_q8kv8_paged_fwd`` on CPU: its checks (the cache's, then the contract's with its messages),
what reaches the launch (the cache's byte view, its layout, a kv_scale of 1.0), the no-launch results of
empty calls, the custom ops, and the float64 reference on a cache written byte by byte.

The device check is patched to accept CPU tensors, and the launch is a stand-in that computes the float64
reference (``sparse_mla_paged_reference``) from what it is given: outputs within bf16 rounding (``out``) and
float32 rounding (``max_logits``, ``lse``) of the reference on the caller's arguments.
"""

import math

import pytest
import torch
from paged_cache import decode_token_f64, empty_cache, fill_random, quantized_cache

from q8kv8 import contract, paged, sparse_mla_q8kv8_paged_fwd
from q8kv8.contract import InputTypeError
from q8kv8.reference import dequantize_paged_cache, sparse_mla_paged_reference, sparse_mla_prefill_reference

S_Q, H_Q, TOPK, PAGES, PAGE_SIZE = 6, 64, 128, 5, 16
D_QK = {"v32": 576, "model1": 512}


def paged_call(generator, layout="v32", s_q=S_Q, h_q=H_Q, q_dtype=torch.bfloat16, **changes) -> dict:
    cache = quantized_cache(layout, PAGES, PAGE_SIZE, generator, pow2_scales=False)
    slots = PAGES * PAGE_SIZE
    indices = torch.randint(-3, slots + 3, (s_q, 1, TOPK), generator=generator, dtype=torch.int32)
    q = torch.randn(s_q, h_q, D_QK[layout], generator=generator).to(q_dtype)
    call = {"q": q, "cache": cache, "indices": indices, "sm_scale": 0.07, "q_scale": None}
    if q_dtype == torch.float8_e4m3fn:
        call["q_scale"] = torch.tensor([0.75])
    return call | changes


@pytest.fixture
def launches(monkeypatch, fake_kernels) -> list[dict]:
    """Accept CPU tensors; the launch checks its cache arguments and writes the float64 reference of the
    rows it is given."""
    recorded = []
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)

    def launch(q, kv, indices, topk_length, attn_sink, q_scale, kv_scale, sm_scale, out, max_logits, lse,
               precision, schedule, ready, splits, split_from, cache):  # fmt: skip
        recorded.append(locals())
        assert cache in ("v32", "model1") and kv.dtype == torch.uint8 and kv.dim() == 3
        assert kv_scale.item() == 1.0 and kv.stride(0) % 16 == 0 and kv.data_ptr() % 16 == 0
        rows = dequantize_paged_cache(
            kv.as_strided((*kv.shape[:2], 1, kv.shape[2]), (*kv.stride()[:2], 1, 1))
        )
        reference = sparse_mla_prefill_reference(
            q, rows, indices, sm_scale, q_scale, 1.0, 512, attn_sink, topk_length
        )
        for buffer, values in zip((out, max_logits, lse), reference, strict=True):
            buffer.copy_(values)

    fake_kernels(None).launch_sparse_prefill = launch
    return recorded


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("layout", ["v32", "model1"])
def test_the_launch_gets_the_cache_view_and_matches_the_reference(generator, launches, layout, q_dtype):
    call = paged_call(generator, layout, q_dtype=q_dtype)
    call["attn_sink"] = torch.randn(H_Q, generator=generator)
    call["topk_length"] = torch.randint(0, TOPK + 1, (S_Q,), generator=generator, dtype=torch.int32)
    out, max_logits, lse = sparse_mla_q8kv8_paged_fwd(**call)
    [launch] = launches
    assert (
        launch["cache"] == layout
        and launch["schedule"] == 0
        and launch["kv"].shape
        == (
            PAGES,
            PAGE_SIZE,
            call["cache"].shape[3],
        )
    )
    assert launch["kv"].stride(0) == call["cache"].stride(0)  # the producers' page stride, padding included
    expected = sparse_mla_paged_reference(**call)
    torch.testing.assert_close(out.double(), expected[0], rtol=2**-8, atol=1e-6)
    torch.testing.assert_close(max_logits.double(), expected[1], rtol=2**-23, atol=1e-6)
    torch.testing.assert_close(lse.double(), expected[2], rtol=2**-23, atol=1e-6)


def test_sixteen_heads_reach_the_launch_as_they_are_and_empty_calls_launch_nothing(generator, launches):
    call = paged_call(generator, h_q=16)
    sparse_mla_q8kv8_paged_fwd(**call)
    assert launches[0]["q"].shape[1] == 16 and launches[0]["schedule"] == 0  # a CPU call's schedule
    empty = sparse_mla_q8kv8_paged_fwd(**call | {"q": call["q"][:0], "indices": call["indices"][:0]})
    assert [t.shape[0] for t in empty] == [0, 0, 0]
    no_pages = sparse_mla_q8kv8_paged_fwd(**call | {"cache": call["cache"][:0]})
    assert (no_pages[0] == 0).all() and (no_pages[1] == -math.inf).all() and (no_pages[2] == math.inf).all()
    assert len(launches) == 1


@pytest.mark.parametrize(
    "change, error, message",
    [
        (lambda c: c | {"cache": c["cache"].float()}, InputTypeError, "cache: expected dtype torch.uint8"),
        (lambda c: c | {"cache": c["cache"][:, :, 0]}, ValueError, r"cache: expected shape \[num_pages"),
        (
            lambda c: c | {"cache": c["cache"][:, :12]},
            ValueError,
            "page_size = cache.shape\\[1\\] a power of two",
        ),
        (
            lambda c: c | {"q": c["q"][..., :512]},
            ValueError,
            "a v32 cache holds d_qk 576, got q with d_qk 512",
        ),
        (lambda c: c | {"indices": c["indices"][..., :100]}, ValueError, "positive multiple of 128"),
        (
            lambda c: c | {"q_scale": torch.ones(1)},
            InputTypeError,
            "q_scale: expected None for a torch.bfloat16",
        ),
        (lambda c: c | {"precision": "exact"}, ValueError, "precision: expected one of"),
        (lambda c: c | {"d_v": 576}, ValueError, "d_v: expected the integer 512"),
    ],
)
def test_errors_name_the_argument(generator, launches, change, error, message):
    with pytest.raises(error, match=message):
        sparse_mla_q8kv8_paged_fwd(**change(paged_call(generator)))
    assert not launches


def test_cache_layout_errors(generator, launches):
    call = paged_call(generator)
    storage = torch.zeros(PAGES * 656 * PAGE_SIZE + 16, dtype=torch.uint8)
    shifted = storage[8 : 8 + PAGES * PAGE_SIZE * 656].view(PAGES, PAGE_SIZE, 1, 656)
    with pytest.raises(ValueError, match="16-byte aligned base"):
        sparse_mla_q8kv8_paged_fwd(**call | {"cache": shifted})
    short = torch.zeros(PAGES, PAGE_SIZE * 656 - 16, dtype=torch.uint8)[:, : (PAGE_SIZE - 1) * 656]
    short = short.view(PAGES, PAGE_SIZE - 1, 1, 656)
    with pytest.raises(ValueError, match="page_size"):
        sparse_mla_q8kv8_paged_fwd(**call | {"cache": short})
    inside = call["cache"]._base.view(-1)[64 : 64 + S_Q * H_Q * 4].view(torch.float32).view(S_Q, H_Q)
    buffers = {"out": torch.empty(S_Q, H_Q, 512, dtype=torch.bfloat16), "lse": torch.empty(S_Q, H_Q)}
    with pytest.raises(
        ValueError, match="max_logits: expected memory of its own, got memory overlapping cache"
    ):
        sparse_mla_q8kv8_paged_fwd(**call, **buffers, max_logits=inside)
    assert not launches


def test_the_ops_run_the_call(generator, launches):
    call = paged_call(generator)
    functional = torch.ops.q8kv8.sparse_mla_q8kv8_paged(
        call["q"], call["cache"], call["indices"], call["sm_scale"], None, 512, None, None, "accurate"
    )
    assert launches[-1]["precision"] == "accurate"
    buffers = (torch.empty(S_Q, H_Q, 512, dtype=torch.bfloat16), torch.empty(S_Q, H_Q), torch.empty(S_Q, H_Q))
    torch.ops.q8kv8.sparse_mla_q8kv8_paged_out(
        call["q"],
        call["cache"],
        call["indices"],
        call["sm_scale"],
        None,
        512,
        None,
        None,
        "accurate",
        *buffers,
    )
    for a, b in zip(functional, buffers, strict=True):
        assert torch.equal(a, b)


def test_dequantized_rows_are_the_decoded_tokens(generator):
    """The reference's cache decoding agrees with the byte-by-byte decoder of the tests (random bytes, NaN
    patterns excluded), both layouts."""
    for layout in ("v32", "model1"):
        cache = empty_cache(layout, 2, 8, extra_page_bytes=32)
        fill_random(cache, 8, layout, generator)
        rows = dequantize_paged_cache(cache)[:, 0]
        expected = torch.tensor(
            [decode_token_f64(cache, s, 8, layout) for s in range(16)], dtype=torch.float64
        )
        assert torch.equal(rows, expected)


def test_check_paged_inputs_reports_the_cache_slots_as_s_kv(generator, monkeypatch):
    monkeypatch.setattr(contract, "check_device", lambda named_devices: None)
    problem, layout, view = paged.check_paged_inputs(paged.PagedCall(**paged_call(generator, "model1")))
    assert layout.name == "model1" and problem.s_kv == PAGES * PAGE_SIZE and view.dtype == torch.uint8


@pytest.mark.parametrize("layout", ["v32", "model1", "v41"])
def test_reference_reads_only_the_selected_slots(layout):
    """``sparse_mla_paged_reference`` dequantises only the slots it reads (a decode batch's cache need not
    fit in float64) and gives, bit for bit, the prefill reference on the whole dequantised cache: slots -1,
    past the cache and past ``topk_length`` ignored, a sink, rows with no slot."""
    generator = torch.Generator().manual_seed(7)
    cache = quantized_cache(layout, 8, 64, generator, pow2_scales=True)
    d_qk = 576 if layout == "v32" else 512
    q = torch.randn(6, 16, d_qk, generator=generator).to(torch.bfloat16)
    indices = torch.randint(-5, 8 * 64 + 40, (6, 1, 128), generator=generator, dtype=torch.int32)
    topk_length = torch.tensor([0, 5, 128, 64, 1, 100], dtype=torch.int32)
    sink = torch.randn(16, generator=generator)
    args = (q, cache, indices, d_qk**-0.5, None, 512, sink, topk_length)
    got = sparse_mla_paged_reference(*args, chunk_rows=4)
    kv = dequantize_paged_cache(cache)
    want = sparse_mla_prefill_reference(
        q, kv, indices, d_qk**-0.5, None, 1.0, 512, sink, topk_length, chunk_rows=4
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.isinf(got[2][0]).all()  # the row with no slot
