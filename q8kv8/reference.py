"""References in plain PyTorch (CPU and GPU), for tests: the float64 sparse MLA prefill, the kernel's
quantisation of a bfloat16 q (``quantize_q_rows``), the bit-exact paged gather, the exact dequantisation of a
paged cache of any ``q8kv8.kv_layout`` layout (``dequantize_paged_cache``), the float64 attention straight
from a paged cache, optionally over a second (extra) cache's slots in the same softmax
(``sparse_mla_paged_reference``), and the serving path's kernels as PyTorch stand-ins
(``reference_kernels``).

The attention reference follows the semantics of ``sparse_mla_q8kv8_prefill_fwd`` (see the README) without
its layout limits: any head count, any ``topk >= 1``, any ``d_qk``, any integer index dtype.
"""

import math

import torch

from q8kv8.arguments import require_int
from q8kv8.kv_layout import LAYOUT_BY_BYTES_PER_TOKEN, KvCacheLayout, get_layout
from q8kv8.metadata import D_V, E4M3_MAX
from q8kv8.paged_gather import out_dtype_of, paged_cache_pages, slot_words
from q8kv8.serving import PrefillKernels

E4M3_MAX_EXPONENT = 8
"""448 = 1.75 * 2^8: the exponent of the largest e4m3 value."""
E4M3_MAX_MANTISSA = 1.75
SCALE_EXPONENTS = (-126, 127)
"""The exponents a row scale of ``quantize_q_rows`` may have: float32's normal powers of two."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each 4-bit e2m1 code (sign, two exponent bits, one mantissa bit)."""
SCALE_DTYPES = {"float32": torch.float32, "ue8m0": torch.float8_e8m0fnu, "e4m3": torch.float8_e4m3fn}
"""The dtype of a layout's block scales (``KvCacheLayout.scale_type``)."""


def quantize_q_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A bfloat16 ``q`` [..., d] quantised to e4m3 as the kernel does it: ``(q_e4m3, row_scale)``, with
    ``row_scale`` float32 of shape ``q.shape[:-1]`` (one per (token, head) row) and
    ``q ~= q_e4m3 * row_scale[..., None]``.

    A row's scale is ``2^e`` with e the smallest integer such that ``amax <= 448 * 2^e`` (amax = max |q| over
    the row, exact in float32), e clamped to [-126, 127]; an all-zero row gets 1. Writing amax = m * 2^E with
    m in [1, 2): e = E - 8 when m <= 1.75, else E - 7. ``q / row_scale``, at most 448 in magnitude and exact
    in float32 (but for quotients below float32's normal range, far under e4m3's smallest value), is rounded
    to nearest even into e4m3, never saturating. ``q`` is finite.
    """
    values = q.float()
    amax = values.abs().amax(dim=-1)
    # In float64 a float32 amax is never subnormal: amax = mantissa * 2^exponent, mantissa in [0.5, 1).
    mantissa, exponent = torch.frexp(amax.double())
    # m = 2 * mantissa, E = exponent - 1: e = E - 8 when m <= 1.75, else E - 7.
    e = exponent - 1 - E4M3_MAX_EXPONENT + (2 * mantissa > E4M3_MAX_MANTISSA).to(exponent.dtype)
    e = torch.where(amax == 0, 0, e.clamp(*SCALE_EXPONENTS))
    # 2^e exactly: float32's bit pattern of a normal power of two.
    row_scale = ((e + 127).to(torch.int32) << 23).view(torch.float32)
    return (values / row_scale[..., None]).to(torch.float8_e4m3fn), row_scale


def sparse_mla_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | float | None,
    kv_scale: torch.Tensor | float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    chunk_rows: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``, all float64 on q's device.

    ``q_scale``: a number or one-element tensor (q's per-tensor scale), a [s_q, h_q] tensor (one scale per
    (token, head) row), or None for a bfloat16 ``q``, which is then quantised as the kernel does it
    (``quantize_q_rows``) and its rows scaled by their own scales. To compare with the exact product of a
    bfloat16 ``q`` instead, pass ``q_scale=1.0``.

    Slot ``j`` of row ``i`` is valid when ``0 <= indices[i, 0, j] < s_kv`` and ``j < topk_length[i]``;
    invalid slots are never gathered. Rows with no valid slot get out 0, max_logits -inf and lse +inf.
    Query rows are processed ``chunk_rows`` at a time; a chunk holds ``chunk_rows * topk * d_qk`` float64s
    of gathered kv.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive row count, got {chunk_rows}")
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    device = q.device
    if q_scale is None:
        if q.dtype != torch.bfloat16:
            raise ValueError(f"q_scale: None only for a bfloat16 q (quantised per row), got q of {q.dtype}")
        q, q_scale = quantize_q_rows(q)
    row_scales = None  # [s_q, h_q, 1] float64 for per-row scales
    if isinstance(q_scale, torch.Tensor) and q_scale.numel() != 1:
        if tuple(q_scale.shape) != (s_q, h_q):
            raise ValueError(f"q_scale: expected one element or shape [s_q, h_q], got {list(q_scale.shape)}")
        row_scales = q_scale.to(device=device, dtype=torch.float64)[..., None]
    # Invalid slots gather the all-zero row appended at index s_kv (which also makes s_kv == 0 work).
    kv_rows = kv[:, 0].to(torch.float64) * float(kv_scale)
    kv_rows = torch.cat([kv_rows, kv_rows.new_zeros(1, kv_rows.shape[-1])])
    slots = torch.arange(topk, device=device)

    out = torch.empty(s_q, h_q, d_v, dtype=torch.float64, device=device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float64, device=device)
    lse = torch.empty(s_q, h_q, dtype=torch.float64, device=device)
    for start in range(0, s_q, chunk_rows):
        rows = slice(start, start + chunk_rows)
        row_indices = indices[rows, 0].long()
        valid = (row_indices >= 0) & (row_indices < s_kv)
        if topk_length is not None:
            valid &= slots < topk_length[rows, None]
        gathered = kv_rows[torch.where(valid, row_indices, s_kv)]  # [rows, topk, d_qk]
        q_rows = q[rows].to(torch.float64)
        q_rows = q_rows * (float(q_scale) if row_scales is None else row_scales[rows])
        logits = torch.einsum("rhd,rtd->rht", q_rows, gathered) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)  # -inf where no slot is valid
        has_valid = valid.any(dim=-1)[:, None]
        # normalised by their sum, not by exp(lse): at logits of 2^53 and more, lse = max + log(count of the
        # maximum) rounds to the maximum
        weights = torch.where(valid[:, None, :], torch.softmax(logits, dim=-1), 0.0)
        row_out = torch.einsum("rht,rtd->rhd", weights, gathered[..., :d_v])
        if attn_sink is not None:
            # 1 / (1 + exp(sink - lse)), exactly 1 for sink -inf and 0 for sink +inf; empty rows stay 0.
            sink_factor = torch.sigmoid(row_lse - attn_sink.to(device=device, dtype=torch.float64))
            row_out = row_out * torch.where(has_valid, sink_factor, 1.0)[..., None]
        out[rows] = row_out
        max_logits[rows] = logits.amax(dim=-1)
        lse[rows] = torch.where(has_valid, row_lse, math.inf)
    return out, max_logits, lse


# ------------------------------------------------------------------------------------------------
# The paged gather and the serving path's kernels in PyTorch
# ------------------------------------------------------------------------------------------------
def gather_dequant_paged_reference(
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    page_size: int,
    layout,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    extra_rows: int = 0,
) -> torch.Tensor:
    """The gather in plain PyTorch (CPU or GPU), bit-exact with the kernel: same arguments, new output
    (``out_dtype`` uint8: a V4.1 FP4 cache's slots as V4.1 records, ``fp4_rows_as_v41``)."""
    layout = get_layout(layout)
    out_dtype = out_dtype_of(out_dtype, layout)
    extra_rows = require_int("extra_rows", extra_rows, 0)
    pages = paged_cache_pages(cache, page_size, layout)
    words = slot_words(slot_ids)
    slots = words[:, 0].long()
    if words.shape[1] == 2:
        slots = torch.where(words[:, 1] == 0, slots, -1)
    num_tokens = slots.shape[0]
    valid = (slots >= 0) & (slots < pages.shape[0] * page_size)
    slots = torch.where(valid, slots, 0)
    page, pos = (slots // page_size)[:, None], (slots % page_size)[:, None]

    def take(offsets: torch.Tensor, count: int) -> torch.Tensor:  # [num_tokens, count] uint8
        if pages.shape[0] == 0:
            return pages.new_zeros(num_tokens, count)
        return pages[page, offsets + torch.arange(count, device=pages.device)]

    if out_dtype == torch.uint8:
        records = fp4_rows_as_v41(take(pos * layout.token_bytes, layout.token_bytes), layout)
        out = torch.zeros(num_tokens + extra_rows, records.shape[1], dtype=torch.uint8, device=pages.device)
        out[:, layout.d_qk :] = 127  # the scales of zero rows: 2^0
        out[:num_tokens] = torch.where(valid[:, None], records, out[:num_tokens])
        return out
    dequant, rope = _decode_tokens(take, pos, page_size, layout, torch.float32)
    if out_dtype == torch.bfloat16:
        row = torch.cat([dequant.to(torch.bfloat16), rope], dim=1)
    else:
        row = torch.cat([dequant, rope.float()], dim=1).clamp(-E4M3_MAX, E4M3_MAX)
    row = torch.where(valid[:, None], row, torch.zeros((), dtype=row.dtype, device=row.device))
    out = torch.zeros(num_tokens + extra_rows, 1, layout.d_qk, dtype=out_dtype, device=pages.device)
    out[:num_tokens, 0] = row.to(out_dtype)
    return out


def fp4_rows_as_v41(data: torch.Tensor, layout: KvCacheLayout) -> torch.Tensor:
    """V4.1 FP4 tokens (``data`` [n, 288] uint8, their bytes) as records of V4.1's layout, [n, 528] uint8: per
    32 values (FP4 blocks 2g and 2g + 1) the UE8M0 scale 2^E, E the least with 6 * max(s_2g, s_2g+1) <= 448 *
    2^E (0 when both are zero), then each value times its block scale times 2^-E rounded once to e4m3."""
    n = data.shape[0]
    raw = data[:, : layout.value_bytes]
    codes = torch.stack([raw & 0xF, raw >> 4], dim=2).flatten(1).long()
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=data.device)[codes]
    scale_bytes = data[:, layout.scale_offset : layout.scale_offset + layout.num_scales].contiguous()
    scales = scale_bytes.view(torch.float8_e4m3fn).double()  # [n, 32], one per 16 values
    bound = 6.0 * scales.view(n, -1, 2).amax(dim=2)  # [n, 16], exact
    mantissa, exponent = torch.frexp(bound)  # bound = mantissa * 2^exponent, mantissa in [0.5, 1)
    ceil_log2 = torch.where(mantissa > 0.5, exponent, exponent - 1)
    group_exponent = ceil_log2 - 9 + (bound > torch.ldexp(torch.full_like(bound, 448.0), ceil_log2 - 9)).int()
    group_exponent = torch.where(bound > 0, group_exponent, 0)
    factor = scales * torch.ldexp(torch.ones_like(scales), -group_exponent.repeat_interleave(2, dim=1))
    scaled = values.view(n, -1, layout.scale_group) * factor[:, :, None]
    e4m3 = scaled.flatten(1).float().to(torch.float8_e4m3fn).view(torch.uint8)  # exact in float32
    return torch.cat([e4m3, (group_exponent + 127).to(torch.uint8)], dim=1)


def _decode_tokens(take, pos: torch.Tensor, page_size: int, layout: KvCacheLayout, dtype: torch.dtype):
    """``(values, rope)`` of the tokens at positions ``pos`` [n, 1] of their pages: each block-scaled value
    times its scale in ``dtype`` (float32: the product rounded once, as the gather computes it; float64:
    exact), [n, d_nope], and the bf16 RoPE values, [n, d_rope]. ``take(offsets [n, 1], count)`` reads
    ``count`` bytes at each token's page offsets. e2m1 codes are decoded by table (``E2M1_VALUES``)."""
    data = take(pos * layout.token_bytes, layout.token_bytes)
    raw = data[:, : layout.value_bytes]
    if layout.value_bits == 4:  # value 2 i in the low nibble of byte i
        codes = torch.stack([raw & 0xF, raw >> 4], dim=2).flatten(1).long()
        values = torch.tensor(E2M1_VALUES, dtype=dtype, device=data.device)[codes]
    else:
        values = raw.contiguous().view(torch.float8_e4m3fn).to(dtype)
    scale_bytes = layout.num_scales * layout.scale_bytes
    if layout.scale_offset is None:  # the page's scale region (MODEL1)
        record = layout.scale_region_offset(page_size) + pos * (layout.bytes_per_token - layout.token_bytes)
        raw_scales = take(record, scale_bytes)
    else:
        raw_scales = data[:, layout.scale_offset : layout.scale_offset + scale_bytes]
    scales = raw_scales.contiguous().view(SCALE_DTYPES[layout.scale_type]).to(dtype)
    grouped = values.view(data.shape[0], layout.num_scales, layout.scale_group) * scales[:, :, None]
    rope = data[:, layout.rope_offset : layout.rope_offset + 2 * layout.d_rope].contiguous()
    return grouped.flatten(1), rope.view(torch.bfloat16)


def dequantize_paged_cache(cache: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
    """Every token slot of a paged cache (``[num_pages, page_size, 1, bytes_per_token]``, any layout of
    ``q8kv8.kv_layout``, told by bytes_per_token), exactly dequantised: ``[num_pages * page_size, 1, d_qk]``
    float64, each block-scaled value times its scale, then the RoPE's bf16 values (if the layout has any).
    ``slots`` (integers in ``[0, num_pages * page_size)``): those slots' rows only, in that order."""
    layout = LAYOUT_BY_BYTES_PER_TOKEN[cache.shape[3]]
    page_size = cache.shape[1]
    pages = paged_cache_pages(cache, page_size, layout)
    if slots is None:
        slots = torch.arange(pages.shape[0] * page_size, device=pages.device)
    else:
        slots = slots.to(device=pages.device, dtype=torch.int64)
    page, pos = (slots // page_size)[:, None], (slots % page_size)[:, None]

    def take(offsets: torch.Tensor, count: int) -> torch.Tensor:  # [num_slots, count] uint8
        return pages[page, offsets + torch.arange(count, device=pages.device)]

    dequant, rope = _decode_tokens(take, pos, page_size, layout, torch.float64)
    rows = torch.cat([dequant, rope.double()], dim=1)
    return rows[:, None, :]


def sparse_mla_paged_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | float | None,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    chunk_rows: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 reference of ``sparse_mla_q8kv8_paged_fwd``: ``sparse_mla_prefill_reference`` on the
    exactly dequantised cache (``dequantize_paged_cache``; only the slots it reads), its indices token slots.

    With ``extra_cache`` (FlashMLA's ``extra_k_cache``, e.g. a V4.1 FP4 cache next to a V4.1 main cache, of
    the same d_qk) and ``extra_indices`` [s_q, 1, extra_topk] (its token slots, -1 or out of range for
    none), each query attends its valid slots of both caches as one softmax: slot ``j`` of the main cache
    counts when ``j < topk_length[i]``, slot ``j`` of the extra one when ``j < extra_topk_length[i]`` (each
    None: all). ``attn_sink`` scales out by ``exp(lse) / (exp(lse) + exp(sink))`` with lse over both."""
    if extra_cache is None and (extra_indices is not None or extra_topk_length is not None):
        raise ValueError("extra_indices, extra_topk_length: expected None without an extra_cache")
    if extra_cache is not None and extra_indices is None:
        raise ValueError("extra_indices: expected the extra cache's slots [s_q, 1, extra_topk], got None")
    kv, index = _selected_rows(cache, indices, topk_length, q.device)
    if extra_cache is not None:
        extra_kv, extra_index = _selected_rows(extra_cache, extra_indices, extra_topk_length, q.device)
        if extra_kv.shape[2] != kv.shape[2]:
            raise ValueError(
                f"extra_cache: expected d_qk {kv.shape[2]} (the cache's), got {extra_kv.shape[2]}"
            )
        index = torch.cat([index, torch.where(extra_index >= 0, extra_index + kv.shape[0], -1)], dim=-1)
        kv = torch.cat([kv, extra_kv])
    return sparse_mla_prefill_reference(
        q, kv, index, sm_scale, q_scale, 1.0, d_v, attn_sink, None, chunk_rows=chunk_rows
    )


def _selected_rows(cache: torch.Tensor, indices, topk_length, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, index)``: the exactly dequantised rows of the slots that ``indices`` selects (each once, on
    ``device``) and ``indices`` as positions among them (-1: no slot, as ``_valid_slots``), so that a
    reference over a large cache dequantises only what it reads."""
    slots = _valid_slots(indices, cache.shape[0] * cache.shape[1], topk_length, device)
    used = torch.unique(slots[slots >= 0])
    index = torch.where(slots >= 0, torch.searchsorted(used, slots.clamp(min=0)), -1)
    return dequantize_paged_cache(cache, used).to(device), index


def _valid_slots(indices: torch.Tensor, num_slots: int, topk_length, device) -> torch.Tensor:
    """``indices`` [s_q, 1, topk] as int64 on ``device``, -1 where a slot is outside ``[0, num_slots)`` or
    at or after its row's ``topk_length`` (None: no limit)."""
    index = indices.to(device=device, dtype=torch.int64)
    valid = (index >= 0) & (index < num_slots)
    if topk_length is not None:
        lengths = topk_length.to(device=device, dtype=torch.int64)
        valid &= torch.arange(index.shape[-1], device=device) < lengths[:, None, None]
    return torch.where(valid, index, -1)


def _reference_attention_fp8(
    q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length, precision=None
):
    out, max_logits, lse = sparse_mla_prefill_reference(
        q, kv, indices, sm_scale, q_scale, kv_scale, D_V, attn_sink, topk_length
    )
    return out.to(torch.bfloat16), max_logits.float(), lse.float()


def _reference_attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length):
    return _reference_attention_fp8(q, kv, indices, sm_scale, 1.0, 1.0, attn_sink, topk_length)


def slot_indices_reference(indices, page_table, seqlens, compress_ratio: int, topk_pad: int):
    """The slot-index kernel in PyTorch: ``(slots [s_q, 1, topk_pad] int32, topk_length [s_q] int32)``;
    ``topk_length`` is ``topk_length_for(seqlens, compress_ratio, topk)``, ``slots[i, 0, j] =
    page_table[indices[i, j]]`` for ``j < topk_length[i]`` where that entry exists (and, for an int64 table,
    is below 2^31), else -1."""
    s_q, topk = indices.shape
    rows = page_table.shape[0]
    seen = (
        seqlens.long()
        if compress_ratio == 0
        else torch.div(seqlens.long(), compress_ratio, rounding_mode="floor")
    )
    length = seen.clamp(0, topk)
    index = indices.long()
    valid = (index >= 0) & (index < rows)
    valid &= torch.arange(topk, device=indices.device)[None, :] < length[:, None]
    slots = page_table.long()[index.clamp(0, max(rows - 1, 0))] if rows else index
    valid &= (slots >= 0) & (slots < 2**31)
    out = torch.full((s_q, 1, topk_pad), -1, dtype=torch.int32, device=indices.device)
    out[:, 0, :topk] = torch.where(valid, slots, -1).to(torch.int32)
    return out, length.to(torch.int32)


def _reference_attention_paged(q, cache, slots, sm_scale, attn_sink, topk_length, precision=None, extra=None):
    extra_cache, extra_indices, extra_topk_length = extra if extra is not None else (None, None, None)
    out, max_logits, lse = sparse_mla_paged_reference(
        q, cache, slots, sm_scale, None, D_V, attn_sink, topk_length,
        extra_cache=extra_cache, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
    )  # fmt: skip
    return out.to(torch.bfloat16), max_logits.float(), lse.float()


def reference_kernels() -> PrefillKernels:
    """PyTorch stand-ins for the GPU kernels (CPU or GPU): the slot-index mapping, the float64 paged attention
    (on the exactly dequantised cache), the bit-exact gather reference and the float64 attention reference
    (outputs cast to the kernels' dtypes)."""

    def gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out):
        result = gather_dequant_paged_reference(cache, slot_ids, page_size, layout, out_dtype, extra_rows)
        if out is None:
            return result
        out.copy_(result)
        return out

    return PrefillKernels(
        slot_indices_reference,
        _reference_attention_paged,
        gather,
        _reference_attention_fp8,
        _reference_attention_bf16,
    )
