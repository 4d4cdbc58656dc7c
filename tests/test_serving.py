"""The paged serving path on CPU: the gather's torch reference (hand-computed bytes, random page
tables), the query cast and padding, the workspace, backend selection, argument checks, and the whole
``SparsePrefill.forward`` pipeline with the PyTorch stand-ins for the GPU kernels against a float64
ground truth computed straight from the cache bytes (``tests/paged_cache.py``).
"""

import math

import pytest
import torch
from paged_cache import (
    BATCH_SHAPES,
    empty_cache,
    expected_rows,
    fill_random,
    ground_truth,
    last_query,
    make_batch,
    same_bits,
    union_ground_truth,
)
from reference_checks import assert_outputs_match

from cute_kernels.interface import PRECISIONS as KERNEL_PRECISIONS
from q8kv8 import kv_layout, metadata, paged_gather, query, serving
from q8kv8.merge import merge_attention
from q8kv8.paged_gather import gather_dequant_requant_fp8_paged
from q8kv8.query import cast_q_fp8, dynamic_q_scale
from q8kv8.reference import (
    gather_dequant_paged_reference,
    reference_kernels,
    slot_indices_reference,
    sparse_mla_prefill_reference,
)
from q8kv8.serving import CacheRows, SparsePrefill
from q8kv8.workspace import SparsePrefillWorkspace, indexed_device

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16


def e4m3_byte(value: float) -> int:
    return torch.tensor([value]).to(E4M3).view(torch.uint8).item()


def values(rows: torch.Tensor) -> torch.Tensor:
    return rows.float()


# ------------------------------------------------------------------------------------------------
# Layout table
# ------------------------------------------------------------------------------------------------
def test_layout_sizes():
    assert (kv_layout.MODEL1.d_qk, kv_layout.V32.d_qk) == (512, 576)
    assert (kv_layout.MODEL1.bytes_per_token, kv_layout.V32.bytes_per_token) == (584, 656)
    assert kv_layout.MODEL1.padded_page_bytes(64) == 65 * 576 == 37440
    assert kv_layout.MODEL1.padded_page_bytes(256) == 260 * 576
    assert kv_layout.MODEL1.scale_region_offset(64) == 64 * 576
    assert kv_layout.V32.padded_page_bytes(64) == 64 * 656
    assert kv_layout.get_layout("v32") is kv_layout.V32
    with pytest.raises(ValueError, match="layout: expected one of"):
        kv_layout.get_layout("v4")


# ------------------------------------------------------------------------------------------------
# Gather reference: hand-computed bytes
# ------------------------------------------------------------------------------------------------
def test_model1_hand_computed_token():
    """Slot 3 = page 1, position 1 of a page_size-2 cache: nope at 576, RoPE at 1024, scales at 1160."""
    cache = empty_cache("model1", num_pages=2, page_size=2)
    assert cache.stride(0) == 3 * 576  # 2 * 584 = 1168 bytes padded to 1728
    page = cache[1].reshape(-1)
    page[576 : 576 + 448] = e4m3_byte(1.125)
    page[576] = e4m3_byte(-1.5)
    rope = torch.ones(64, dtype=BF16)
    rope[:5] = torch.tensor([1000.0, -1e6, 0.3, 0.0, -0.0])
    page[1024:1152] = rope.view(torch.uint8)
    page[1160:1167] = torch.tensor(
        [127, 128, 126, 135, 136, 0, 118], dtype=torch.uint8
    )  # 1, 2, .5, 2^8, 2^9, 2^-127, 2^-9

    slots = torch.tensor([3, 0, -1, 4], dtype=torch.int32)  # 4 = num_pages * page_size: out of range
    fp8 = gather_dequant_paged_reference(cache, slots, 2, "model1", E4M3, extra_rows=2)
    assert fp8.shape == (6, 1, 512) and fp8.dtype == E4M3
    row = values(fp8[0, 0])
    nope = torch.tensor([1.125, 2.25, 0.5625, 288.0, 448.0, 0.0, 2.0**-9]).repeat_interleave(64)
    nope[0] = -1.5
    assert torch.equal(row[:448], nope)  # 576 saturates to 448, 1.125 * 2^-127 flushes, 1.125 * 2^-9 rounds
    assert torch.equal(row[448:453], torch.tensor([448.0, -448.0, 0.3125, 0.0, 0.0]))
    assert row[451].item() == 0.0 and math.copysign(1.0, row[452].item()) == -1.0  # -0 stays -0
    assert torch.equal(row[453:], torch.ones(59))
    assert (fp8[1:].view(torch.uint8) == 0).all()  # slot 0 holds zero bytes; invalid and extra rows zero

    bf16 = gather_dequant_paged_reference(cache, slots, 2, "model1", BF16, extra_rows=2)
    row = values(bf16[0, 0])
    nope = torch.tensor([1.125, 2.25, 0.5625, 288.0, 576.0, 1.125 * 2.0**-127, 1.125 * 2.0**-9])
    nope = nope.repeat_interleave(64)
    nope[0] = -1.5
    assert torch.equal(row[:448], nope)
    assert torch.equal(bf16[0, 0, 448:], rope)
    assert (bf16[1:].view(torch.int16) == 0).all()


def test_v32_hand_computed_token():
    """Slot 2 = page 1, position 0: a 656-byte record: nope, 4 float32 scales at 512, RoPE at 528."""
    cache = empty_cache("v32", num_pages=2, page_size=2)
    page = cache[1].reshape(-1)
    page[:512] = e4m3_byte(1.125)
    page[0] = e4m3_byte(-1.5)
    page[512:528] = torch.tensor([1.5, 2.0**-7, 1000.0, 3.0]).view(torch.uint8)
    rope = torch.linspace(-2, 2, 64).to(BF16)
    page[528:656] = rope.view(torch.uint8)

    fp8 = gather_dequant_paged_reference(cache, torch.tensor([2, 1]), 2, "v32", E4M3)
    row = values(fp8[0, 0])
    # 1.6875 and 3.375 are ties between e4m3 neighbours: even mantissas win (1.75, 3.5); 1.125 * 2^-7
    # = 4.5 * 2^-9 is a tie between subnormals: 4 * 2^-9; 1125 saturates.
    nope = torch.tensor([1.75, 2.0**-7, 448.0, 3.5]).repeat_interleave(128)
    nope[0] = -2.25
    assert torch.equal(row[:512], nope)
    assert torch.equal(row[512:], rope.float().to(E4M3).float())
    assert (fp8[1].view(torch.uint8) == 0).all()

    bf16 = gather_dequant_paged_reference(cache, torch.tensor([2]), 2, "v32", BF16)
    nope = torch.tensor([1.6875, 1.125 * 2.0**-7, 1128.0, 3.375]).repeat_interleave(128)  # bf16(1125) = 1128
    nope[0] = -2.25
    assert torch.equal(values(bf16[0, 0, :512]), nope)
    assert torch.equal(bf16[0, 0, 512:], rope)


def test_model1_scale_byte_255_is_nan_and_254_saturates():
    cache = empty_cache("model1", num_pages=1, page_size=4)
    page = cache[0].reshape(-1)
    page[: 4 * 576] = e4m3_byte(1.0)
    page[4 * 576 : 4 * 576 + 7] = torch.tensor([254, 255, 127, 127, 127, 127, 127], dtype=torch.uint8)
    row = values(gather_dequant_paged_reference(cache, torch.tensor([0]), 4, "model1")[0, 0])
    assert (row[:64] == 448.0).all() and torch.isnan(row[64:128]).all() and (row[128:448] == 1.0).all()
    row = values(gather_dequant_paged_reference(cache, torch.tensor([0]), 4, "model1", BF16)[0, 0])
    assert (row[:64] == 2.0**127).all() and torch.isnan(row[64:128]).all()


# ------------------------------------------------------------------------------------------------
# Gather reference: random caches and page tables against the independent decoder
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("out_dtype", [E4M3, BF16], ids=["e4m3", "bf16"])
@pytest.mark.parametrize("extra_rows", [0, 5])
@pytest.mark.parametrize("page_size", [64, 256])
@pytest.mark.parametrize("layout", ["model1", "v32", "v41", "v41_fp4"])
def test_reference_matches_decoder_on_random_page_tables(
    generator, layout, page_size, extra_rows, out_dtype, slot_dtype
):
    cache = empty_cache(layout, num_pages=3, page_size=page_size, extra_page_bytes=48)
    fill_random(cache, page_size, layout, generator, scale_bytes=(100, 160))
    num_slots = 3 * page_size
    slots = torch.randint(0, num_slots, (70,), generator=generator)
    slots[::9] = slots[1::9][: len(slots[::9])]  # duplicates
    slots[5], slots[17], slots[30] = -1, num_slots, -(2**31)
    got = gather_dequant_paged_reference(
        cache, slots.to(slot_dtype), page_size, layout, out_dtype, extra_rows
    )
    assert got.shape == (70 + extra_rows, 1, 576 if layout == "v32" else 512)
    assert same_bits(got, expected_rows(cache, slots.tolist(), page_size, layout, out_dtype, extra_rows))
    assert not torch.isnan(got.float()).any()


@pytest.mark.parametrize("layout", ["model1", "v32"])
def test_reference_is_nan_free_over_every_finite_byte(generator, layout):
    """Every finite e4m3 nope byte, every finite UE8M0 scale byte (0..254), huge float32 scales and RoPE
    values: the e4m3 output saturates instead of overflowing to NaN."""
    cache = empty_cache(layout, num_pages=2, page_size=64)
    fill_random(cache, 64, layout, generator, scale_bytes=(0, 255))
    if layout == "v32":
        for slot in range(0, 128, 3):
            page, pos = divmod(slot, 64)
            cache[page].reshape(-1)[pos * 656 + 512 : pos * 656 + 528] = torch.tensor(
                [3e38, 1e-40, 7.0, 1e30]
            ).view(torch.uint8)
    got = gather_dequant_paged_reference(cache, torch.arange(128), 64, layout)
    assert not torch.isnan(got.float()).any()
    assert got.float().abs().max() == 448.0
    assert same_bits(got, expected_rows(cache, list(range(128)), 64, layout, E4M3))


def test_int64_slots_beyond_int32_are_invalid():
    cache = empty_cache("v32", num_pages=1, page_size=4)
    fill_random(cache, 4, "v32", torch.Generator().manual_seed(1))
    slots = torch.tensor([2**32 + 1, 1, 2**31, -(2**40)], dtype=torch.int64)
    got = gather_dequant_paged_reference(cache, slots, 4, "v32")
    assert (got[[0, 2, 3]].view(torch.uint8) == 0).all()
    assert same_bits(got[1:2], expected_rows(cache, [1], 4, "v32", E4M3))


def test_float8_view_of_the_cache_and_empty_tables():
    cache = empty_cache("model1", num_pages=2, page_size=64)
    fill_random(cache, 64, "model1", torch.Generator().manual_seed(2))
    slots = torch.tensor([5, 70, 127])
    assert torch.equal(
        gather_dequant_paged_reference(cache.view(E4M3), slots, 64, "model1").view(torch.uint8),
        gather_dequant_paged_reference(cache, slots, 64, "model1").view(torch.uint8),
    )
    empty = gather_dequant_paged_reference(
        cache, torch.zeros(0, dtype=torch.int32), 64, "model1", extra_rows=3
    )
    assert empty.shape == (3, 1, 512) and (empty.view(torch.uint8) == 0).all()


# ------------------------------------------------------------------------------------------------
# Argument checks of the gather (they run before the device check, so they work on CPU)
# ------------------------------------------------------------------------------------------------
def _gather(**overrides):
    args = {
        "cache_u8": empty_cache("v32", 2, 64),
        "slot_ids": torch.arange(10, dtype=torch.int32),
        "page_size": 64,
        "layout": "v32",
        "extra_rows": 0,
        "out": None,
    }
    args.update(overrides)
    return gather_dequant_requant_fp8_paged(**args)


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (
            {"cache_u8": torch.zeros(2, 64 * 656, dtype=torch.int8)},
            TypeError,
            "cache: expected dtype torch.uint8",
        ),
        ({"cache_u8": torch.zeros(64 * 656, dtype=torch.uint8)}, ValueError, "at least 2 dims"),
        (
            {"cache_u8": torch.zeros(2, 64 * 656 - 1, dtype=torch.uint8)},
            ValueError,
            "pages of at least 41984",
        ),
        ({"cache_u8": torch.zeros(2, 656, 64, dtype=torch.uint8).transpose(1, 2)}, ValueError, "contiguous"),
        ({"page_size": 0}, ValueError, "page_size: expected an integer >= 1"),
        ({"page_size": 64.0}, TypeError, "page_size: expected a Python int"),
        ({"page_size": 65}, ValueError, "pages of at least"),
        ({"layout": "model2"}, ValueError, "layout: expected one of"),
        ({"layout": "model1", "page_size": 72}, ValueError, "pages of at least 42048"),
        ({"slot_ids": torch.arange(10.0)}, TypeError, "slot_ids: expected dtype torch.int32 or torch.int64"),
        ({"slot_ids": torch.zeros(2, 5, dtype=torch.int32)}, ValueError, "slot_ids: expected a 1-D tensor"),
        ({"extra_rows": -1}, ValueError, "extra_rows: expected an integer >= 0"),
        ({"out": torch.zeros(10, 1, 576, dtype=BF16)}, TypeError, "out: expected dtype torch.float8_e4m3fn"),
        ({"out": torch.zeros(11, 1, 576, dtype=E4M3)}, ValueError, r"out: expected shape \[10, 1, 576\]"),
        ({"out": torch.zeros(10, 1, 1152, dtype=E4M3)[..., ::2]}, ValueError, "out: expected a contiguous"),
        ({}, ValueError, "cache: expected a CUDA tensor, got device cpu"),
    ],
)
def test_gather_argument_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        _gather(**overrides)


@pytest.fixture
def gather_memo(monkeypatch) -> dict:
    """The gather's memo, empty, with CPU tensors accepted (its device check replaced by a recorder) and the
    launch recorded: ``{"device_checks": [...], "launches": [(pages, words, out, page_size, layout)]}``."""
    record = {"device_checks": [], "launches": []}
    monkeypatch.setattr(paged_gather, "_memo", {})
    monkeypatch.setattr(paged_gather, "_check_devices", lambda *a: record["device_checks"].append(a))
    monkeypatch.setattr(
        paged_gather.kernels, "launch_paged_kv_gather", lambda *a: record["launches"].append(a)
    )
    return record


def test_gather_memo_answers_a_repeated_call_and_checks_any_change(gather_memo):
    """A repeated valid call skips the checks and launches what the checked call launched; new buffers,
    other sizes, an in-place change the checks would catch, and invalid arguments are checked again."""
    cache, slots = empty_cache("v32", 2, 64), torch.arange(10, dtype=torch.int32)
    out = torch.empty(12, 1, 576, dtype=E4M3)
    for _ in range(3):
        assert _gather(cache_u8=cache, slot_ids=slots, out=out, extra_rows=2) is out
    assert len(gather_memo["device_checks"]) == 1
    first, *later = gather_memo["launches"]
    for launch in later:
        pages, words, launched_out, page_size, layout, rows = launch
        assert rows is None  # e4m3 rows: no record slots
        assert (pages.data_ptr(), pages.shape, pages.stride()) == (
            first[0].data_ptr(),
            first[0].shape,
            first[0].stride(),
        )
        assert torch.equal(words, first[1]) and launched_out is out and (page_size, layout) == (64, "v32")
    assert first[0].shape == (2, 64 * 656) and first[0].dtype == torch.uint8
    _gather(cache_u8=cache, slot_ids=slots, out=torch.empty(12, 1, 576, dtype=E4M3), extra_rows=2)  # moved
    _gather(cache_u8=cache, slot_ids=slots, extra_rows=2)  # allocating
    assert len(gather_memo["device_checks"]) == 3
    out.set_(cache.untyped_storage(), 0, (12, 1, 576), (576, 576, 1))  # same object, now inside the cache
    with pytest.raises(ValueError, match="out: expected memory of its own"):
        _gather(cache_u8=cache, slot_ids=slots, out=out, extra_rows=2)
    for overrides, error in (
        ({"page_size": True}, TypeError),  # equal to 1 as a key, but not a Python int
        ({"extra_rows": 2.0}, TypeError),
        ({"layout": ["v32"]}, ValueError),  # unhashable: checked without the memo
    ):
        size = len(paged_gather._memo)
        with pytest.raises(error):
            _gather(cache_u8=cache, slot_ids=slots, **overrides)
        assert len(paged_gather._memo) == size  # errors are never memoised


def test_gather_records_launch_with_their_slots(gather_memo):
    """V4.1 records (out_dtype uint8) launch with a [num_tokens] int32 buffer for their token slots: the
    caller's, checked as out is, or one of their own; other outputs take none."""
    cache, slots = empty_cache("v41_fp4", 2, 64), torch.arange(10, dtype=torch.int32)
    rows = torch.empty(10, dtype=torch.int32)
    gather = paged_gather.gather_dequant_paged
    out = gather(cache, slots, 64, "v41_fp4", torch.uint8, rows=rows)
    assert out.shape == (10, 528) and gather_memo["launches"][-1][-1] is rows
    gather(cache, slots, 64, "v41_fp4", torch.uint8, 2)  # allocating them, extra rows beside
    allocated = gather_memo["launches"][-1][-1]
    assert allocated.shape == (10,) and allocated.dtype == torch.int32
    for rows_arg, error, match in (
        (torch.empty(10, dtype=torch.int64), TypeError, "rows: expected dtype torch.int32"),
        (torch.empty(11, dtype=torch.int32), ValueError, r"rows: expected shape \[10\]"),
        (torch.empty(20, dtype=torch.int32)[::2], ValueError, "rows: expected a contiguous"),
        (slots, ValueError, "rows: expected memory of its own, got memory overlapping slot_ids"),
    ):
        with pytest.raises(error, match=match):
            gather(cache, slots, 64, "v41_fp4", torch.uint8, rows=rows_arg)
    with pytest.raises(ValueError, match="rows: expected None unless out_dtype is torch.uint8"):
        gather(cache, slots, 64, "v41_fp4", E4M3, rows=rows)
    launches = len(gather_memo["launches"])
    zeros = gather(empty_cache("v41_fp4", 0, 64), slots, 64, "v41_fp4", torch.uint8, rows=rows)  # no slot
    assert len(gather_memo["launches"]) == launches and (rows == -1).all() and (zeros[:, 512:] == 127).all()


def test_gather_rejects_out_overlapping_the_cache():
    cache = empty_cache("v32", 2, 64)
    out = cache.reshape(-1)[: 10 * 576].view(E4M3).view(10, 1, 576)
    with pytest.raises(ValueError, match="out: expected memory of its own"):
        _gather(cache_u8=cache, out=out)


def test_gather_requires_16_byte_alignment():
    storage = torch.zeros(2 * 41992 + 16, dtype=torch.uint8)
    shifted = storage[1 : 1 + 2 * 41984].view(2, 64, 1, 656)
    with pytest.raises(ValueError, match="cache: expected a 16-byte aligned base and page stride"):
        _gather(cache_u8=shifted)
    odd_stride = storage[: 2 * 41992].view(2, 41992)[:, :41984].view(2, 64, 1, 656)  # 41992 = 16 * 2624 + 8
    with pytest.raises(ValueError, match="got page stride 41992 bytes"):
        _gather(cache_u8=odd_stride)
    out = torch.zeros(10 * 576 + 1, dtype=torch.uint8)[1:].view(E4M3).view(10, 1, 576)
    with pytest.raises(ValueError, match="out: expected a 16-byte aligned buffer"):
        _gather(out=out)


def test_paged_cache_pages_views_any_page_stride():
    cache = empty_cache("model1", 3, 64, extra_page_bytes=32)
    pages = paged_gather.paged_cache_pages(cache, 64, "model1")
    assert pages.shape == (3, 64 * 584) and pages.stride() == (37440 + 32, 1)
    assert pages.data_ptr() == cache.data_ptr()
    one = paged_gather.paged_cache_pages(cache[:1], 64, "model1")
    assert one.stride(0) % 16 == 0


# ------------------------------------------------------------------------------------------------
# Query side
# ------------------------------------------------------------------------------------------------
def expected_q_fp8(q: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3(float32(q / scale)), computed in float64 then rounded once to float32."""
    return (q.double() / scale).float().clamp(-448.0, 448.0).to(E4M3)


@pytest.mark.parametrize("h", [1, 64, 70])
def test_cast_q_fp8_rounds_saturates_and_pads(generator, h):
    q = (torch.randn(5, h, 576, generator=generator) * 40).to(BF16)
    q[0, 0, :3] = torch.tensor([1e5, -1e5, 0.0])
    scale = torch.tensor([0.37])
    out = cast_q_fp8(q, scale)
    assert out.shape == (5, -(-h // 64) * 64, 576) and out.dtype == E4M3
    assert torch.equal(out[:, :h].view(torch.uint8), expected_q_fp8(q, 0.37).view(torch.uint8))
    assert (out[:, h:].view(torch.uint8) == 0).all()
    assert values(out[0, 0, :2]).tolist() == [448.0, -448.0]


def test_cast_q_fp8_reuses_out_and_rezeroes_padding(generator, monkeypatch):
    monkeypatch.setattr(query, "_CAST_CHUNK_ELEMENTS", 3 * 10 * 512)  # several row chunks
    q = torch.randn(7, 10, 512, generator=generator).to(BF16)
    out = torch.full((7, 64, 512), 0x7E, dtype=torch.uint8).view(E4M3)
    assert cast_q_fp8(q, 0.5, out=out) is out
    assert torch.equal(out[:, :10].view(torch.uint8), expected_q_fp8(q, 0.5).view(torch.uint8))
    assert (out[:, 10:].view(torch.uint8) == 0).all()
    with pytest.raises(ValueError, match="out: expected shape"):
        cast_q_fp8(q, 0.5, out=torch.empty(7, 10, 512, dtype=E4M3))
    with pytest.raises(ValueError, match="q_scale: expected a positive number"):
        cast_q_fp8(q, 0.0)
    with pytest.raises(TypeError, match="q: expected a torch.bfloat16 tensor"):
        cast_q_fp8(q.float(), 1.0)


def test_dynamic_q_scale_is_the_smallest_sufficient_power_of_two(generator):
    q = (torch.randn(3, 4, 512, generator=generator) * 30).to(BF16)
    scale = dynamic_q_scale(q)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    amax = q.float().abs().max().item()
    assert math.log2(scale.item()).is_integer()
    assert scale.item() >= amax / 448 > scale.item() / 2
    cast = cast_q_fp8(q, scale)
    assert not torch.isnan(cast.float()).any() and cast.float().abs().max() <= 448
    assert dynamic_q_scale(torch.zeros(2, 3, 512, dtype=BF16)).item() == torch.finfo(torch.float32).tiny


@pytest.mark.parametrize("h", [3, 64, 100])
def test_padded_heads_do_not_change_real_heads(generator, h):
    """The float64 reference on the padded Q (zero heads) and sink (-inf) equals the unpadded call."""
    q = torch.randn(6, h, 576, generator=generator).to(BF16)
    kv = (torch.randn(300, 1, 576, generator=generator)).to(E4M3)
    indices = torch.randint(-1, 300, (6, 1, 128), generator=generator, dtype=torch.int32)
    sink = torch.randn(h, generator=generator)
    topk_length = torch.tensor([0, 5, 128, 64, 1, 100], dtype=torch.int32)
    scale = dynamic_q_scale(q)
    q8 = cast_q_fp8(q, scale)
    padded_sink = torch.cat([sink, torch.full((q8.shape[1] - h,), -math.inf)])
    padded = sparse_mla_prefill_reference(q8, kv, indices, 0.04, scale, 1.0, 512, padded_sink, topk_length)
    plain = sparse_mla_prefill_reference(q8[:, :h], kv, indices, 0.04, scale, 1.0, 512, sink, topk_length)
    for a, b in zip(padded, plain, strict=True):
        assert torch.allclose(a[:, :h], b, rtol=1e-12, atol=1e-12, equal_nan=True)


# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------
def test_workspace_reallocates_only_when_needed():
    ws = SparsePrefillWorkspace("cpu")
    big = ws.get(100, E4M3)
    assert big.shape == (100, 1, 576) and ws.allocations == 1
    small = ws.get(40, E4M3)
    assert small.data_ptr() == big.data_ptr() and small.shape == (40, 1, 576) and ws.allocations == 1
    assert ws.get(100, E4M3, d_qk=512).data_ptr() == big.data_ptr() and ws.allocations == 1
    other = ws.get(40, BF16)  # dtype change: a new buffer
    assert other.dtype == BF16 and ws.allocations == 2
    assert ws.get(40, BF16).data_ptr() == other.data_ptr() and ws.allocations == 2
    grown = ws.get(41, BF16)  # does not fit
    assert ws.allocations == 3 and ws.get(10, BF16).data_ptr() == grown.data_ptr()
    assert ws.capacity_bytes == 41 * 576 * 2
    ws.reserve(500, E4M3)
    assert ws.allocations == 4 and ws.get(499, E4M3).data_ptr() == ws.get(3, E4M3).data_ptr()
    assert ws.get(0, E4M3).shape == (0, 1, 576)
    with pytest.raises(TypeError, match="out_dtype"):
        ws.get(4, torch.float16)


def test_indexed_device_gives_cuda_without_an_index_the_current_device(monkeypatch):
    """A workspace made with "cuda" compares its buffer's device (always indexed, "cuda:N") with the
    device torch allocates "cuda" on, so it reuses the buffer (tests/test_serving_gpu.py allocates)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == torch.device("cuda", 3)
    assert indexed_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")


# ------------------------------------------------------------------------------------------------
# Backend selection and the bf16 kernel hook
# ------------------------------------------------------------------------------------------------
def test_backend_resolution(monkeypatch):
    monkeypatch.delenv(serving.BACKEND_ENV, raising=False)
    assert SparsePrefill().backend == "fp8"
    assert SparsePrefill("bf16").backend == "bf16"
    with pytest.raises(ValueError, match=r"backend: expected one of \('auto', 'bf16', 'fp8'\), got 'fp16'"):
        SparsePrefill("fp16")
    monkeypatch.setenv(serving.BACKEND_ENV, "bf16")
    assert SparsePrefill("fp8").backend == "bf16"
    monkeypatch.setenv(serving.BACKEND_ENV, "auto")
    assert SparsePrefill("bf16").backend == "fp8"
    monkeypatch.setenv(serving.BACKEND_ENV, "BF16")
    with pytest.raises(ValueError, match=r"\$Q8KV8_PREFILL_BACKEND: expected one of"):
        SparsePrefill()


def test_bf16_kernel_hook_receives_the_documented_arguments(fake_kernels):
    module = fake_kernels(lambda *args: None)
    calls = []

    def launch_sparse_prefill_bf16(q, kv, indices, topk_length, attn_sink, sm_scale, out, max_logits, lse):
        calls.append(locals())
        out.fill_(1.0)
        max_logits.fill_(2.0)
        lse.fill_(3.0)

    module.launch_sparse_prefill_bf16 = launch_sparse_prefill_bf16
    q, kv = torch.zeros(2, 64, 576, dtype=BF16), torch.zeros(3, 1, 576, dtype=BF16)
    indices, topk_length = torch.zeros(2, 1, 128, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    out, max_logits, lse = serving.cuda_kernels().attention_bf16(q, kv, indices, 0.25, None, topk_length)
    (call,) = calls
    assert call["q"] is q and call["kv"] is kv and call["indices"] is indices
    assert call["topk_length"] is topk_length and call["attn_sink"] is None and call["sm_scale"] == 0.25
    assert out.shape == (2, 64, 512) and out.dtype == BF16 and (out == 1).all()
    assert max_logits.shape == lse.shape == (2, 64) and (max_logits == 2).all() and (lse == 3).all()


# ------------------------------------------------------------------------------------------------
# The whole pipeline with the PyTorch kernels, against the float64 ground truth
# ------------------------------------------------------------------------------------------------
SM_SCALE = 0.06


def run_pipeline(batch, backend, h_sink=None, extra_rows=0, path="auto", **kwargs):
    prefill = SparsePrefill(
        backend,
        path=path,
        extra_rows=extra_rows,
        kernels=reference_kernels(),
        workspace=SparsePrefillWorkspace("cpu"),
    )
    out = prefill.forward(
        batch["q"],
        batch["cache"],
        kwargs.get("page_table", batch["page_table"]),
        kwargs.get("indices", batch["indices"]),
        batch["seqlens"],
        batch["compress_ratio"],
        SM_SCALE,
        h_sink,
    )
    return prefill, out


def assert_close_to_truth(got, truth, out_tol, stat_tol):
    out, max_logits, lse = got
    assert out.dtype == BF16 and max_logits.dtype == lse.dtype == torch.float32
    assert_outputs_match(got, truth, out_tol, stat_tol)


@pytest.mark.parametrize("backend, path", [("fp8", "paged"), ("fp8", "workspace"), ("bf16", "auto")])
@pytest.mark.parametrize("compress_ratio", [0, 4, 128])
@pytest.mark.parametrize("layout", ["model1", "v32"])
def test_pipeline_matches_float64_ground_truth(generator, layout, compress_ratio, backend, path):
    batch = make_batch(layout, 64, compress_ratio, h=20, topk=16, generator=generator)
    sink = torch.randn(20, generator=generator)
    prefill, got = run_pipeline(batch, backend, sink, path=path)
    assert got[0].shape == (batch["q"].shape[0], 20, 512)
    assert prefill.last_path == ("paged" if path == "paged" else "workspace")
    # Same rounding as the pipeline (q in e4m3, the cache as it is on the paged path, the gathered rows in
    # e4m3 or bf16 on the workspace path): only output rounding remains.
    kv_format = {"paged": "f64", "workspace": "e4m3" if backend == "fp8" else "bf16"}[prefill.last_path]
    same = ground_truth(batch, layout, SM_SCALE, sink, kv_format=kv_format, quantize_q=backend == "fp8")
    assert_close_to_truth(got, same, out_tol=4e-3, stat_tol=1e-6)
    # The exact dequantised cache and bf16 q: the FP8 rounding of q and kv is the difference.
    exact = ground_truth(batch, layout, SM_SCALE, sink)
    fp8 = backend == "fp8"
    assert_close_to_truth(got, exact, out_tol=6e-2 if fp8 else 5e-3, stat_tol=0.15 if fp8 else 1e-2)
    assert (batch["n_valid"] == 0).any() == (compress_ratio > 0)  # queries that see no row yet


@pytest.mark.parametrize("h", [64, 128])
def test_pipeline_unpadded_heads_int64_table_3d_indices_and_landing_rows(generator, h):
    batch = make_batch("v32", 64, 4, h=h, topk=200, generator=generator, garbage_tail=False)
    indices = batch["indices"][:, None, :]
    prefill, got = run_pipeline(
        batch, "fp8", extra_rows=7, path="workspace", page_table=batch["page_table"].long(), indices=indices
    )
    same = ground_truth(batch, "v32", SM_SCALE, kv_format="e4m3", quantize_q=True)
    assert_close_to_truth(got, same, out_tol=4e-3, stat_tol=1e-6)
    num_rows = batch["page_table"].shape[0]
    workspace = prefill.workspace.get(num_rows + 7, E4M3)
    assert (workspace[num_rows:].view(torch.uint8) == 0).all()  # the landing zone is zero
    assert same_bits(
        workspace[:num_rows], expected_rows(batch["cache"], batch["page_table"].tolist(), 64, "v32", E4M3)
    )


def test_pipeline_reuses_its_buffers(generator):
    batch = make_batch("model1", 64, 0, h=8, topk=16, generator=generator)
    prefill = SparsePrefill(
        "fp8", path="workspace", kernels=reference_kernels(), workspace=SparsePrefillWorkspace("cpu")
    )
    args = (batch["q"], batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0, SM_SCALE)
    first = prefill.forward(*args)
    pointer, allocations = prefill.workspace.get(1, E4M3, 512).data_ptr(), prefill.workspace.allocations
    half = batch["q"].shape[0] // 2
    smaller = (batch["q"][:half], *args[1:3], batch["indices"][:half], batch["seqlens"][:half], 0, SM_SCALE)
    second = prefill.forward(*smaller)
    assert prefill.workspace.allocations == allocations
    assert prefill.workspace.get(1, E4M3, 512).data_ptr() == pointer
    assert torch.equal(second[0], first[0][:half]) and torch.equal(second[2], first[2][:half])


def recording_kernels(calls: list):
    """``reference_kernels()`` whose attention records the tensors it is given."""
    kernels = reference_kernels()

    def attention_paged(q, cache, slots, sm_scale, attn_sink, topk_length, precision, extra=None):
        calls.append({"q": q, "cache": cache, "attn_sink": attn_sink, "precision": precision, "extra": extra})
        return kernels.attention_paged(q, cache, slots, sm_scale, attn_sink, topk_length, precision, extra)

    def attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length, precision):
        calls.append({"q": q, "q_scale": q_scale, "kv_scale": kv_scale, "attn_sink": attn_sink})
        calls[-1].update(precision=precision, topk_length=topk_length)
        return kernels.attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length)

    def attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length):
        calls.append({"q": q, "attn_sink": attn_sink, "topk_length": topk_length})
        return kernels.attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length)

    return kernels._replace(
        attention_paged=attention_paged, attention_fp8=attention_fp8, attention_bf16=attention_bf16
    )


@pytest.mark.parametrize("backend", ["fp8", "bf16"])
def test_workspace_path_hands_int32_seqlens_as_topk_length(generator, backend, monkeypatch):
    """Padded indices of an uncompressed cache: int32 seqlens go to the kernel as topk_length as they are
    (it clamps them to [0, topk]; no launch); int64 ones, a compressed cache and ``Q8KV8_CHECK_RANGES=1``
    (which has the kernel raise for values past topk) get them clamped to [0, topk] first. Same outputs."""
    batch = make_batch("v32", 64, 0, h=16, topk=128, generator=generator, garbage_tail=False)
    seqlens = batch["seqlens"] + 64  # some past topk (a longer request: the same rows, all of them valid)
    assert batch["indices"].shape[1] == 128 and int(seqlens.max()) > 128
    args = [batch["q"], batch["cache"], batch["page_table"], batch["indices"]]
    results, lengths = [], []
    for seqlens_arg, check_ranges in ((seqlens, "0"), (seqlens.long(), "0"), (seqlens, "1")):
        monkeypatch.setenv("Q8KV8_CHECK_RANGES", check_ranges)
        calls = []
        prefill = SparsePrefill(backend, path="workspace", kernels=recording_kernels(calls))
        results.append(prefill.forward(*args, seqlens_arg, 0, SM_SCALE))
        lengths.append(calls[0]["topk_length"])
    assert lengths[0] is seqlens
    for clamped in lengths[1:]:
        assert clamped.dtype == torch.int32 and torch.equal(clamped, seqlens.clamp(0, 128))
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result, results[0], strict=True))


@pytest.mark.parametrize("backend, path", [("fp8", "paged"), ("fp8", "workspace"), ("bf16", "auto")])
@pytest.mark.parametrize("h", [128, 48])
def test_pipeline_hands_the_kernel_the_bf16_q(generator, backend, path, h):
    """The FP8 backend passes the bfloat16 Q with ``q_scale=None`` (the kernel scales each row; no Q cast, no
    per-tensor scale) and the cached one-element kv_scale 1.0: Q itself, any head count (the bf16 backend
    likewise, without scales); a strided Q is copied into a reusable contiguous bfloat16 buffer."""
    batch = make_batch("v32", 64, 0, h=h, topk=16, generator=generator)
    calls = []
    prefill = SparsePrefill(
        backend, path=path, kernels=recording_kernels(calls), workspace=SparsePrefillWorkspace("cpu")
    )
    args = (batch["q"], batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0, SM_SCALE)
    first = prefill.forward(*args)
    second = prefill.forward(*args)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert all(t.shape[:2] == (batch["q"].shape[0], h) for t in first)
    q = batch["q"]
    for call in calls:
        assert call["q"] is q
        if path == "workspace":
            assert call["q_scale"] is None
            assert call["kv_scale"] is calls[0]["kv_scale"] and call["kv_scale"].tolist() == [1.0]
        elif path == "paged":
            assert call["cache"] is batch["cache"]  # the cache itself: no workspace
    assert (prefill.workspace.allocations == 0) == (path == "paged")  # the paged path allocates none
    assert prefill._q.allocations == 0
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    for _ in range(2):
        prefill.forward(strided, *args[1:])
        assert calls[-1]["q"] is not strided and calls[-1]["q"].is_contiguous()
        assert torch.equal(calls[-1]["q"], q)
    assert calls[-1]["q"].data_ptr() == calls[-2]["q"].data_ptr() and prefill._q.allocations == 1


def test_pipeline_fp8_backend_quantises_each_row_of_q_with_its_own_scale(generator):
    """Heads of very different magnitudes (2^-8 .. 2^8): the FP8 backend's result is the float64 attention
    of the rows quantised one by one, and every head's logits keep the relative accuracy of e4m3; with one
    scale for the whole tensor the small heads' q would fall among e4m3's subnormals."""
    batch = make_batch("model1", 64, 0, h=64, topk=16, generator=generator)
    factors = torch.exp2(torch.linspace(-8, 8, 64).round())
    batch["q"] = (batch["q"].float() * factors[None, :, None]).to(BF16)
    _, got = run_pipeline(batch, "fp8", path="paged")
    same = ground_truth(batch, "model1", SM_SCALE, quantize_q=True)  # the paged path reads the cache as it is
    assert_close_to_truth(got, same, out_tol=4e-3, stat_tol=1e-6)

    def median_relative_error(max_logits, exact):  # of max_logits, per head, over rows with a valid slot
        full = exact[2] != math.inf
        error = (max_logits.double() - exact[1]).abs() / exact[1].abs().clamp(min=1e-300)
        return torch.stack([error[:, head][full[:, head]].median() for head in range(64)])

    exact = ground_truth(batch, "model1", SM_SCALE)  # the bfloat16 q, unrounded
    per_row_error = median_relative_error(got[1], exact)
    assert per_row_error.max() < 0.03  # about 1% for every head
    q = batch["q"]
    scale = dynamic_q_scale(q)
    per_tensor = {**batch, "q": (cast_q_fp8(q, scale)[:, :64].float() * scale).to(BF16)}
    per_tensor_error = median_relative_error(ground_truth(per_tensor, "model1", SM_SCALE)[1], exact)
    assert per_tensor_error[:4].min() > 3 * per_row_error.max()  # the smallest heads near e4m3's subnormals


def test_topk_length_per_compress_ratio():
    seqlens = torch.tensor([0, 1, 3, 4, 127, 128, 129, 255, 256, 5000])
    assert serving.topk_length_for(seqlens, 0, 2048).tolist() == [0, 1, 3, 4, 127, 128, 129, 255, 256, 2048]
    assert serving.topk_length_for(seqlens, 4, 512).tolist() == [0, 0, 0, 1, 31, 32, 32, 63, 64, 512]
    assert serving.topk_length_for(seqlens, 128, 2048).tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2, 39]
    assert serving.topk_length_for(seqlens, 4, 512).dtype == torch.int32
    with pytest.raises(ValueError, match=r"compress_ratio: expected one of \(0, 4, 128\)"):
        serving.topk_length_for(seqlens, 64, 2048)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (
            {"q": torch.zeros(4, 8, 512, dtype=BF16)},
            ValueError,
            r"q: expected d_qk = 576 \(the v32 cache's\)",
        ),
        ({"q": torch.zeros(4, 8, 576)}, TypeError, "q: expected dtype torch.bfloat16"),
        ({"cache": torch.zeros(2, 64, 1, 600, dtype=torch.uint8)}, ValueError, "bytes_per_token in"),
        ({"page_table": torch.zeros(5)}, TypeError, "page_table: expected a 1-D int32 or int64"),
        (
            {"indices": torch.zeros(4, 128, dtype=torch.int64)},
            TypeError,
            "indices: expected dtype torch.int32",
        ),
        ({"indices": torch.zeros(4, 2, 128, dtype=torch.int32)}, ValueError, "indices: expected shape"),
        (
            {"seqlens": torch.zeros(5, dtype=torch.int32)},
            ValueError,
            r"seqlens: expected shape \[s_q\] = \[4\]",
        ),
        ({"seqlens": torch.zeros(4)}, TypeError, "seqlens: expected an integer tensor"),
        ({"compress_ratio": 2}, ValueError, "compress_ratio: expected one of"),
        ({"sm_scale": math.nan}, ValueError, "sm_scale: expected a finite Python number"),
        ({"attn_sink": torch.zeros(9)}, ValueError, r"attn_sink: expected shape \[h\] = \[8\]"),
    ],
)
def test_forward_argument_errors(change, error, match):
    args = {
        "q": torch.zeros(4, 8, 576, dtype=BF16),
        "cache": empty_cache("v32", 2, 64),
        "page_table": torch.arange(10, dtype=torch.int32),
        "indices": torch.zeros(4, 128, dtype=torch.int32),
        "seqlens": torch.ones(4, dtype=torch.int32),
        "compress_ratio": 0,
        "sm_scale": 0.1,
        "attn_sink": None,
    }
    args.update(change)
    with pytest.raises(error, match=match):
        SparsePrefill("fp8", kernels=reference_kernels()).forward(**args)


def test_batch_shapes_cover_every_ratio():
    assert sorted(BATCH_SHAPES) == sorted(serving.COMPRESS_RATIOS)


def test_precision_reaches_the_kernel_and_the_environment_overrides_it(generator, monkeypatch):
    batch = make_batch("v32", 64, 0, h=16, topk=16, generator=generator)
    args = (batch["q"], batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0, SM_SCALE)
    for path in ("paged", "workspace"):
        for precision in ("accurate", "accurate_logits"):
            calls = []
            prefill = SparsePrefill("fp8", precision=precision, path=path, kernels=recording_kernels(calls))
            prefill.forward(*args)
            assert [call["precision"] for call in calls] == [precision]
    monkeypatch.setenv(serving.PRECISION_ENV, "default")
    assert SparsePrefill(precision="accurate").precision == "default"
    monkeypatch.setenv(serving.PRECISION_ENV, "exact")
    with pytest.raises(ValueError, match=r"\$Q8KV8_PRECISION: expected one of"):
        SparsePrefill()
    monkeypatch.delenv(serving.PRECISION_ENV)
    with pytest.raises(ValueError, match="precision: expected one of"):
        SparsePrefill(precision="exact")
    with pytest.raises(ValueError, match="path: expected one of"):
        SparsePrefill(path="gathered")


@pytest.mark.parametrize("path", ["paged", "workspace"])
def test_merged_parts_sum_logits_in_float32(generator, path):
    """Each part of ``forward_merged`` runs the layer's precision with S summed in float32 (its lse weighs the
    output in the merge); a call, with or without a sink, and the paged path's joined call of two parts pass
    the precision as it is (a sink's call sums in float32 in the kernel's plan: test_launch_cpu.py)."""
    batch = make_batch("model1", 64, 0, h=16, topk=16, generator=generator)
    args = (batch["q"], batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0, SM_SCALE)
    sink = torch.randn(16, generator=generator)
    part = CacheRows(batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0)
    for precision, summed in metadata.LOGITS_IN_FLOAT32.items():
        calls = []
        prefill = SparsePrefill("fp8", precision=precision, path=path, kernels=recording_kernels(calls))
        prefill.forward(*args)
        prefill.forward(*args, sink)
        prefill.forward_merged(batch["q"], [part, part], SM_SCALE, sink)  # paged: one call, both caches
        merged = [precision] if path == "paged" else [summed] * 2
        assert [call["precision"] for call in calls] == [precision] * 2 + merged, precision
        assert prefill.info()["precision"] == precision
    for precision, summed in metadata.LOGITS_IN_FLOAT32.items():  # P's terms kept, S in float32
        assert KERNEL_PRECISIONS[summed] == KERNEL_PRECISIONS[precision]._replace(qk_in_float32=True)
    assert set(metadata.LOGITS_IN_FLOAT32) == set(metadata.PRECISIONS)


@pytest.mark.parametrize("table_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("compress_ratio", [0, 4, 128])
def test_slot_indices_map_rows_to_slots_and_count_the_valid_ones(generator, table_dtype, compress_ratio):
    """Rows of the page table to its slots before each query's valid count, -1 for every other entry
    (negative, past the table, an int64 entry at 2^31 or more, at or past the count), padded with -1 to the
    padded top-k; the valid counts as ``topk_length_for``."""
    table = torch.randint(0, 10000, (300,), generator=generator).to(table_dtype)
    if table_dtype == torch.int64:
        table[7] = 2**31
    indices = torch.randint(-5, 310, (9, 200), generator=generator, dtype=torch.int32)
    indices[0, :3] = torch.tensor([7, 299, 300])
    seqlens = torch.randint(0, 3000, (9,), generator=generator)
    seqlens[0] = 200 * max(compress_ratio, 1) + 5  # every slot of row 0 counts
    seqlens[1] = 50 * max(compress_ratio, 1)  # 50 of row 1's
    slots, topk_length = slot_indices_reference(indices, table, seqlens, compress_ratio, 256)
    assert slots.shape == (9, 1, 256) and slots.dtype == topk_length.dtype == torch.int32
    assert torch.equal(topk_length, serving.topk_length_for(seqlens, compress_ratio, 200))
    assert topk_length[0] == 200 and topk_length[1] == 50
    expected = [
        [
            int(table[i]) if 0 <= i < 300 and int(table[i]) < 2**31 and j < length else -1
            for j, i in enumerate(row.tolist())
        ]
        + [-1] * 56
        for row, length in zip(indices, topk_length.tolist(), strict=True)
    ]
    assert slots[:, 0].tolist() == expected
    assert slots[0, 0, :3].tolist()[1:] == [int(table[299]), -1]


def test_auto_path_attends_from_the_cache_when_the_workspace_would_gather_more(generator):
    """The "auto" path: paged when the page table holds more than ``PAGED_ROWS_PER_TILE_SLOT`` rows per (tile
    of 64 heads, top-k slot) of the batch (a decode step over long prefixes), else the workspace (a prefill
    chunk)."""
    batch = make_batch("v32", 64, 0, h=16, topk=16, generator=generator)
    s_q, num_rows = batch["q"].shape[0], batch["page_table"].shape[0]
    args = (batch["q"], batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0, SM_SCALE)
    prefill = SparsePrefill("fp8", kernels=reference_kernels())
    prefill.forward(*args)
    rule = "paged" if num_rows > serving.PAGED_ROWS_PER_TILE_SLOT * s_q * 128 else "workspace"
    assert prefill.last_path == rule == "workspace"  # dozens of queries over 127 rows
    one = tuple(
        t[:1] if t is batch["q"] or t is batch["indices"] or t is batch["seqlens"] else t for t in args
    )
    prefill.forward(*one)  # one query over 127 rows: 127 > 0.4 * 128
    assert prefill.last_path == "paged" and prefill.workspace is not None
    assert SparsePrefill("bf16", path="paged", kernels=reference_kernels())._choose_path(
        1, 64, 128, 10**6, kv_layout.V32, 64
    ) == ("workspace")
    auto = SparsePrefill("fp8", kernels=reference_kernels())
    assert auto._choose_path(1, 64, 128, 10**6, kv_layout.V32, 64) == "paged"
    assert auto._choose_path(1, 64, 128, 10**6, kv_layout.V41, 64) == "paged"
    assert auto._choose_path(1, 64, 128, 10**6, kv_layout.V41_FP4, 64) == "workspace"  # the gather reads it
    assert auto._choose_path(1, 64, 128, 10**6, kv_layout.V41, 48) == "workspace"  # paged: pages of 2^n


def test_auto_takes_the_workspace_for_pages_not_of_a_power_of_two(generator):
    """A decode step over pages of 48 tokens, where the rule would read the cache directly: "auto" gathers
    (the paged call takes pages of a power-of-two size only), as the float64 reference on the gathered e4m3
    rows."""
    batch = last_query(make_batch("v41", 48, 0, h=16, topk=16, generator=generator))
    prefill, got = run_pipeline(batch, "fp8")
    assert prefill.last_path == "workspace"
    same = ground_truth(batch, "v41", SM_SCALE, kv_format="e4m3", quantize_q=True)
    assert_close_to_truth(got, same, out_tol=4e-3, stat_tol=1e-6)


def test_workspace_path_takes_padded_indices_as_they_are(generator):
    """Indices already padded to a multiple of 128 and row-major reach the kernel as they are (a view, no
    slot-index pass); others are padded with -1."""
    seen = []
    kernels = reference_kernels()

    def attention_fp8(q, kv, indices, *args):
        seen.append(indices)
        return kernels.attention_fp8(q, kv, indices, *args)

    batch = make_batch("v32", 64, 0, h=20, topk=128, generator=generator)
    prefill = SparsePrefill(
        "fp8",
        path="workspace",
        kernels=kernels._replace(attention_fp8=attention_fp8),
        workspace=SparsePrefillWorkspace("cpu"),
    )
    args = (batch["cache"], batch["page_table"], batch["indices"], batch["seqlens"], 0, SM_SCALE)
    got = prefill.forward(batch["q"], *args)
    assert seen[-1].data_ptr() == batch["indices"].data_ptr() and seen[-1].shape == (len(batch["q"]), 1, 128)
    assert_close_to_truth(
        got, ground_truth(batch, "v32", SM_SCALE, kv_format="e4m3", quantize_q=True), 4e-3, 1e-6
    )
    prefill.forward(batch["q"], batch["cache"], batch["page_table"], batch["indices"][:, :100], *args[3:])
    assert seen[-1].shape == (len(batch["q"]), 1, 128) and (seen[-1][:, 0, 100:] == -1).all()


def test_merge_attention_is_one_softmax_over_the_union(generator):
    """Two parts of each row's slots (some rows empty in one part, some in both), merged with a sink, against
    the float64 attention over all of them: float32 rounding only."""
    s_q, h, d = 12, 5, 576
    q = torch.randn(s_q, h, d, generator=generator, dtype=torch.float64)
    kv = torch.randn(300, 1, d, generator=generator, dtype=torch.float64)
    indices = torch.stack([torch.randperm(300, generator=generator)[:40] for _ in range(s_q)])
    first, second = indices[:, :25].clone(), indices[:, 25:].clone()
    first[3], second[4] = -1, -1  # row 3 only in the second part, row 4 only in the first
    first[7], second[7] = -1, -1  # row 7 in neither
    sink = torch.randn(h, generator=generator, dtype=torch.float64)
    whole = torch.cat([first, second], dim=1)
    want = sparse_mla_prefill_reference(q, kv, whole[:, None], 0.05, 1.0, 1.0, 512, sink)
    parts = [
        sparse_mla_prefill_reference(q, kv, part[:, None], 0.05, 1.0, 1.0, 512) for part in (first, second)
    ]
    got = merge_attention([tuple(t.float() for t in part) for part in parts], sink.float())
    assert (got[0][7] == 0).all() and (got[1][7] == -math.inf).all() and (got[2][7] == math.inf).all()
    assert torch.allclose(got[0].double(), want[0], rtol=1e-5, atol=1e-6)
    sink[1] = math.inf  # a head's sink takes all of its rows, and an empty row stays 0 (not NaN)
    edge = merge_attention([tuple(t.float() for t in part) for part in parts], sink.float())[0]
    assert (edge[:, 1] == 0).all() and torch.equal(edge[:, 2:], got[0][:, 2:])
    assert torch.equal(got[1], want[1].float())
    assert torch.allclose(got[2].double(), want[2], rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="at least one"):
        merge_attention([])
    with pytest.raises(ValueError, match=r"parts\[1\]: expected out"):
        merge_attention([got, (got[0][:3], got[1][:3], got[2][:3])])


@pytest.mark.parametrize("path", ["paged", "workspace"])
def test_forward_merged_attends_two_caches_as_one_softmax(generator, path):
    """V4's compressed rows and window rows live in two caches: ``forward_merged`` attends both as one
    softmax, with the sink applied once, against the float64 attention over the union of the rows."""
    compressed = make_batch("model1", 64, 4, h=20, topk=16, generator=generator)
    window = make_batch("model1", 64, 4, h=20, topk=8, generator=generator)  # a second cache, same queries
    sink = torch.randn(20, generator=generator)
    prefill = SparsePrefill(
        "fp8", path=path, kernels=reference_kernels(), workspace=SparsePrefillWorkspace("cpu")
    )
    parts = [
        CacheRows(b["cache"], b["page_table"], b["indices"], b["seqlens"], b["compress_ratio"])
        for b in (compressed, window)
    ]
    got = prefill.forward_merged(compressed["q"], parts, SM_SCALE, sink)
    joined = "paged" if path == "paged" else "workspace+workspace"  # two paged parts: one paged call
    assert prefill.last_path == joined and prefill.info()["last_path"] == prefill.last_path
    kv_format = "f64" if path == "paged" else "e4m3"
    q = compressed["q"]
    truth = union_ground_truth(q, [compressed, window], "model1", SM_SCALE, sink, kv_format, quantize_q=True)
    assert_close_to_truth(got, truth, out_tol=4e-3, stat_tol=1e-6)
    assert ((compressed["n_valid"] == 0) & (window["n_valid"] == 0)).any()  # rows that see nothing yet
    with pytest.raises(ValueError, match="at least one CacheRows"):
        prefill.forward_merged(q, [], SM_SCALE)


@pytest.mark.parametrize("path", ["auto", "paged", "workspace"])
@pytest.mark.parametrize("fp4_first", [False, True])
def test_forward_merged_reads_a_v41_fp4_cache_in_the_v41_paged_call(generator, path, fp4_first):
    """A V4.1 cache and its FP4 cache: where the V4.1 part takes the paged path ("auto" on a decode step, or
    forced), ``forward_merged`` runs one paged call with the FP4 cache as its extra cache (its selected slots
    read as V4.1 records), in either order of the parts, the layer's precision as it is; on the workspace
    path the parts are merged by lse. Against the float64 attention over the union of the rows."""
    main = last_query(make_batch("v41", 64, 0, h=20, topk=16, generator=generator))
    fp4 = last_query(make_batch("v41_fp4", 64, 0, h=20, topk=8, generator=generator))  # the same query
    sink = torch.randn(20, generator=generator)
    calls = []
    prefill = SparsePrefill(
        "fp8", path=path, kernels=recording_kernels(calls), workspace=SparsePrefillWorkspace("cpu")
    )
    batches, layouts = [main, fp4], ["v41", "v41_fp4"]
    if fp4_first:
        batches, layouts = batches[::-1], layouts[::-1]
    parts = [
        CacheRows(b["cache"], b["page_table"], b["indices"], b["seqlens"], b["compress_ratio"])
        for b in batches
    ]
    got = prefill.forward_merged(main["q"], parts, SM_SCALE, sink)
    if path == "workspace":
        assert prefill.last_path == "workspace+workspace" and len(calls) == 2
        kv_format = "e4m3"
    else:
        assert prefill.last_path == "paged" and len(calls) == 1
        assert calls[0]["cache"] is main["cache"] and calls[0]["extra"][0] is fp4["cache"]
        assert calls[0]["extra"][2] is None  # each part's slots -1 from its length on: nothing to mask
        assert calls[0]["precision"] == prefill.precision and calls[0]["attn_sink"] is not None
        kv_format = "f64"
    truth = union_ground_truth(main["q"], batches, layouts, SM_SCALE, sink, kv_format, quantize_q=True)
    assert_close_to_truth(got, truth, out_tol=4e-3, stat_tol=1e-6)


def test_forward_merged_merges_a_v41_fp4_part_of_other_page_sizes(generator):
    """An FP4 cache of pages of 48 tokens (which the paged call does not read; the gather does): its part
    stays on the workspace path, merged by lse with the V4.1 part's paged call."""
    main = last_query(make_batch("v41", 64, 0, h=20, topk=16, generator=generator))
    fp4 = last_query(make_batch("v41_fp4", 48, 0, h=20, topk=8, generator=generator))
    sink = torch.randn(20, generator=generator)
    prefill = SparsePrefill("fp8", kernels=reference_kernels(), workspace=SparsePrefillWorkspace("cpu"))
    parts = [CacheRows(b["cache"], b["page_table"], b["indices"], b["seqlens"], 0) for b in (main, fp4)]
    got = prefill.forward_merged(main["q"], parts, SM_SCALE, sink)
    assert prefill.last_path == "paged+workspace"
    # the V4.1 rows as the paged call reads them (exactly), the FP4 rows as the workspace holds them
    layouts, kv_formats = ["v41", "v41_fp4"], ["f64", "e4m3"]
    truth = union_ground_truth(main["q"], [main, fp4], layouts, SM_SCALE, sink, kv_formats, True)
    assert_close_to_truth(got, truth, out_tol=4e-3, stat_tol=1e-6)


def test_info_says_what_the_layer_runs(generator):
    batch = make_batch("v32", 64, 0, h=20, topk=16, generator=generator)
    paged, _ = run_pipeline(batch, "fp8", path="paged")
    assert paged.info() == {
        "backend": "fp8",
        "precision": "default",
        "path": "paged",
        "last_path": "paged",
        "paged_rows_per_tile_slot": serving.PAGED_ROWS_PER_TILE_SLOT,
        "workspace_bytes": 0,
    }
    workspace, _ = run_pipeline(batch, "fp8", path="auto")
    info = workspace.info()
    assert info["last_path"] == "workspace" and info["path"] == "auto"
    assert info["workspace_bytes"] == batch["page_table"].shape[0] * 576
