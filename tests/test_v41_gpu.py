"""DeepSeek V4.1's paged caches on an H100/H200 (``gpu`` marker): the workspace path, i.e. a V4.1 main
cache's and a V4.1 FP4 extra cache's selected slots gathered into one workspace of e4m3 rows (scale 1), then
``sparse_mla_q8kv8_prefill_fwd`` over both parts' rows as one softmax (sink and per-part valid counts
included), against float64.

Tolerances, as the serving path's workspace tests (``test_serving_gpu.py``): against the float64 attention
on the rows the kernel is given (the gathered e4m3 rows), out within 4e-2 (``||out - ref|| / ||ref||``, the
kernel rounds P to e4m3) and max_logits / lse within 1e-2; against the exact float64 reference on the caches
(``sparse_mla_paged_reference`` with the extra cache), out within 8e-2 and max_logits / lse within 0.15:
the FP4 rows' products (up to 6 significant bits) are rounded once to e4m3. The bf16 rows of both V4.1
layouts are exact: checked bit for bit against the float64 dequantisation.
"""

import pytest
import torch
from paged_cache import quantized_cache, to_device
from reference_checks import assert_outputs_match

from q8kv8 import gather_dequant_requant_fp8_paged, sparse_mla_q8kv8_prefill_fwd
from q8kv8.paged_gather import gather_dequant_paged
from q8kv8.reference import (
    dequantize_paged_cache,
    gather_dequant_paged_reference,
    sparse_mla_paged_reference,
    sparse_mla_prefill_reference,
)

pytestmark = pytest.mark.gpu

E4M3, BF16 = torch.float8_e4m3fn, torch.bfloat16
PAGE_SIZE, SM_SCALE = 64, 512**-0.5


def workspace_indices(indices, topk_length, extra_indices, extra_topk_length, main_rows, extra_rows):
    """Both parts' slots as rows of one workspace (the main cache's gathered rows first, then the extra
    cache's): -1 for every invalid slot or one at or after its part's valid count, padded with -1 to a
    multiple of 128 slots."""
    parts = []
    for slots, length, rows, first in (
        (indices, topk_length, main_rows, 0),
        (extra_indices, extra_topk_length, extra_rows, main_rows),
    ):
        index = slots.long()
        valid = (
            (index >= 0)
            & (index < rows)
            & (torch.arange(index.shape[-1], device=index.device) < length[:, None, None])
        )
        parts.append(torch.where(valid, index + first, -1))
    joined = torch.cat(parts, dim=-1)
    pad = -joined.shape[-1] % 128
    return torch.nn.functional.pad(joined, (0, pad), value=-1).to(torch.int32)


def make_call(generator, s_q, h, topk, extra_topk, pages=24, extra_pages=12):
    main = quantized_cache("v41", pages, PAGE_SIZE, generator, pow2_scales=True, extra_page_bytes=0)
    extra = quantized_cache(
        "v41_fp4", extra_pages, PAGE_SIZE, generator, pow2_scales=True, extra_page_bytes=32
    )
    indices = torch.randint(-2, pages * PAGE_SIZE + 2, (s_q, 1, topk), generator=generator, dtype=torch.int32)
    extra_indices = torch.randint(
        -2, extra_pages * PAGE_SIZE + 2, (s_q, 1, extra_topk), generator=generator, dtype=torch.int32
    )
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    extra_topk_length = torch.randint(0, extra_topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    topk_length[:2], extra_topk_length[0] = 0, 0  # a query with no valid slot, one with the extra part's only
    return {
        "q": (torch.randn(s_q, h, 512, generator=generator) * 0.5).to(BF16).cuda(),
        "cache": to_device(main, "cuda"),
        "indices": indices.cuda(),
        "topk_length": topk_length.cuda(),
        "extra_cache": to_device(extra, "cuda"),
        "extra_indices": extra_indices.cuda(),
        "extra_topk_length": extra_topk_length.cuda(),
        "attn_sink": torch.randn(h, generator=generator).cuda(),
    }


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("h", [64, 16])
def test_workspace_path_matches_float64(generator, h, precision):
    call = make_call(generator, 40, h, 512, 256)
    main_rows = call["cache"].shape[0] * PAGE_SIZE
    extra_rows = call["extra_cache"].shape[0] * PAGE_SIZE
    all_main = torch.arange(main_rows, dtype=torch.int32, device="cuda")
    all_extra = torch.arange(extra_rows, dtype=torch.int32, device="cuda")
    kv = torch.empty(main_rows + extra_rows, 1, 512, dtype=E4M3, device="cuda")
    gather_dequant_requant_fp8_paged(call["cache"], all_main, PAGE_SIZE, "v41", out=kv[:main_rows])
    gather_dequant_requant_fp8_paged(call["extra_cache"], all_extra, PAGE_SIZE, "v41_fp4", out=kv[main_rows:])
    indices = workspace_indices(
        call["indices"], call["topk_length"], call["extra_indices"], call["extra_topk_length"],
        main_rows, extra_rows,
    )  # fmt: skip
    one = torch.ones(1, device="cuda")
    outputs = sparse_mla_q8kv8_prefill_fwd(
        call["q"], kv, indices, SM_SCALE, None, one, attn_sink=call["attn_sink"], precision=precision
    )
    torch.cuda.synchronize()
    on_rows = sparse_mla_prefill_reference(
        call["q"], kv.double(), indices, SM_SCALE, None, 1.0, 512, call["attn_sink"], chunk_rows=16
    )
    rel = assert_outputs_match(outputs, on_rows, 4e-2, 1e-2)
    exact = sparse_mla_paged_reference(
        call["q"], call["cache"], call["indices"], SM_SCALE, None, 512, call["attn_sink"],
        call["topk_length"], extra_cache=call["extra_cache"], extra_indices=call["extra_indices"],
        extra_topk_length=call["extra_topk_length"], chunk_rows=16,
    )  # fmt: skip
    rel_exact = assert_outputs_match(outputs, exact, 8e-2, 0.15)
    print(f"v41 workspace h {h} {precision}: on its rows {rel:.2e}, exact {rel_exact:.2e}")


@pytest.mark.parametrize("layout", ["v41", "v41_fp4"])
def test_bf16_rows_are_exact(generator, layout):
    """On values of normal magnitude each V4.1 value times its scale has at most 8 significant bits (e4m3
    times a power of two; e2m1 times e4m3: 2 + 4 bits), so the bf16 gather is the float64 dequantisation."""
    cache = quantized_cache(layout, 8, PAGE_SIZE, generator, pow2_scales=True, std=3.0)
    slots = torch.randperm(8 * PAGE_SIZE, generator=generator).to(torch.int32)
    got = gather_dequant_paged(to_device(cache, "cuda"), slots.cuda(), PAGE_SIZE, layout, BF16).cpu()
    torch.cuda.synchronize()
    assert torch.equal(got.double(), dequantize_paged_cache(cache)[slots.long()])


@pytest.mark.parametrize("std", [1.0, 1e-4])
def test_fp4_records_match_the_reference_bit_for_bit(generator, std):
    """The gather's V4.1 records of FP4 tokens (``out_dtype`` uint8): the reference's bytes, values and
    scales, with invalid slots and extra rows zero at scale 2^0; and ``rows``, each slot's record or -1."""
    cache = quantized_cache("v41_fp4", 8, PAGE_SIZE, generator, pow2_scales=False, std=std)
    slots = torch.randint(-2, 8 * PAGE_SIZE + 2, (300,), generator=generator, dtype=torch.int32)
    rows = torch.full((300,), 7, dtype=torch.int32, device="cuda")  # poisoned
    got = gather_dequant_paged(
        to_device(cache, "cuda"), slots.cuda(), PAGE_SIZE, "v41_fp4", torch.uint8, 3, rows=rows
    )
    torch.cuda.synchronize()
    want = gather_dequant_paged_reference(cache, slots, PAGE_SIZE, "v41_fp4", torch.uint8, 3)
    assert torch.equal(got.cpu(), want)
    valid = (slots >= 0) & (slots < 8 * PAGE_SIZE)
    assert torch.equal(rows.cpu(), torch.where(valid, torch.arange(300, dtype=torch.int32), -1))
