"""The paged KV gather: token slots of a paged FP8 cache into contiguous e4m3 or bf16 rows, one GPU kernel.

A paged cache is ``[num_pages, ...]`` with each page's bytes contiguous; slot ``s`` is position
``s % page_size`` of page ``s // page_size``. The cache layouts are described in ``q8kv8.kv_layout`` and
``cute_kernels/sm90/paged_kv.py``; ``q8kv8.reference.gather_dequant_paged_reference`` is the bit-exact
PyTorch version. Arguments are checked on shapes, dtypes, strides and devices only: no host sync.
"""

from __future__ import annotations

import math

import torch

from q8kv8 import checks, kernels
from q8kv8.arguments import check_buffer, require_int
from q8kv8.checks import overlaps, require_aligned_pages, signature
from q8kv8.kv_layout import RECORDS_FROM, RECORDS_LAYOUT, get_layout


def paged_cache_pages(cache: torch.Tensor, page_size: int, layout) -> torch.Tensor:
    """``cache`` as ``[num_pages, page_bytes]`` uint8 (a view, no copy), checked against ``layout``.

    ``cache``: uint8 (or a float8_e4m3fn view of the same bytes), at least 2-D, the first dim the
    pages, the other dims contiguous inside a page (any page stride); each page must hold the
    ``page_size * bytes_per_token`` bytes the layout reads.
    """
    layout = get_layout(layout)
    page_size = require_int("page_size", page_size, 1)
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in (torch.uint8, torch.float8_e4m3fn):
        raise TypeError(f"cache: expected dtype torch.uint8 (or torch.float8_e4m3fn), got {cache.dtype}")
    if cache.dim() < 2:
        raise ValueError(
            f"cache: expected [num_pages, ...] with at least 2 dims, got shape {list(cache.shape)}"
        )
    pages = cache.view(torch.uint8)
    num_pages, page_bytes = pages.shape[0], math.prod(pages.shape[1:])
    expected_stride = 1
    for size, stride in zip(reversed(pages.shape[1:]), reversed(pages.stride()[1:]), strict=True):
        if size != 1 and stride != expected_stride:
            raise ValueError(
                f"cache: expected the dims after the first (one page) to be contiguous, got shape "
                f"{list(cache.shape)} with strides {list(cache.stride())}"
            )
        expected_stride *= size
    needed = layout.min_page_bytes(page_size)
    if page_bytes < needed:
        raise ValueError(
            f"cache: expected pages of at least {needed} bytes (layout {layout.name}, page_size {page_size}: "
            f"{page_size} x {layout.bytes_per_token}), got {page_bytes} bytes per page "
            f"(shape {list(cache.shape)})"
        )
    page_stride = pages.stride(0)
    if num_pages > 1 and page_stride < page_bytes:
        raise ValueError(f"cache: pages overlap (page stride {page_stride} < {page_bytes} bytes per page)")
    if num_pages <= 1:  # the stride is never used; keep it a multiple of 16 for the kernel
        page_stride = -(-max(page_bytes, 1) // 16) * 16
    return pages.as_strided((num_pages, page_bytes), (page_stride, 1))


def slot_words(slot_ids: torch.Tensor) -> torch.Tensor:
    """``slot_ids`` ([num_tokens] int32 or int64) as ``[num_tokens, 1 or 2]`` int32 words (a view of an
    int32 table or of a contiguous int64 one, little-endian: low word first)."""
    if not isinstance(slot_ids, torch.Tensor):
        raise TypeError(f"slot_ids: expected a torch.Tensor, got {type(slot_ids).__name__}")
    if slot_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_ids: expected dtype torch.int32 or torch.int64, got {slot_ids.dtype}")
    if slot_ids.dim() != 1:
        raise ValueError(f"slot_ids: expected a 1-D tensor [num_tokens], got shape {list(slot_ids.shape)}")
    if slot_ids.dtype == torch.int32:
        return slot_ids.unsqueeze(1)
    return slot_ids.contiguous().view(torch.int32).view(slot_ids.shape[0], 2)


RECORDS = torch.uint8
"""The gather's ``out_dtype`` for V4.1 records: a V4.1 FP4 cache's slots as ``[rows, 528]`` uint8 tokens of
V4.1's layout (``q8kv8.reference.fp4_rows_as_v41``), a cache of one token a page that the paged kernel
reads."""


def out_dtype_of(out_dtype, layout=None) -> torch.dtype:
    """``out_dtype`` when the gather writes it from ``layout`` (records only from a V4.1 FP4 cache)."""
    if out_dtype == RECORDS and layout is not None and layout.name == RECORDS_FROM:
        return out_dtype
    if out_dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise TypeError(
            f"out_dtype: expected torch.float8_e4m3fn or torch.bfloat16 (torch.uint8: V4.1 records, from a "
            f"v41_fp4 cache), got {out_dtype}"
        )
    return out_dtype


def out_shape(layout, rows: int, out_dtype: torch.dtype) -> tuple[int, ...]:
    """The gather's output shape for ``rows`` rows: ``[rows, 1, d_qk]``, or ``[rows, 528]`` records."""
    if out_dtype == RECORDS:
        return (rows, get_layout(RECORDS_LAYOUT).bytes_per_token)
    return (rows, 1, layout.d_qk)


def gather_dequant_paged(
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    page_size: int,
    layout,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    extra_rows: int = 0,
    out: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather token slots of a paged FP8 cache into contiguous ``[num_tokens + extra_rows, 1, d_qk]``
    rows of ``out_dtype`` (e4m3 with per-tensor scale 1.0, or bf16) on the GPU; see
    ``gather_dequant_requant_fp8_paged``. The bf16 rows hold the dequantised nope (rounded to bf16)
    and the RoPE values unchanged. V4.1 records (``out_dtype`` uint8, from a V4.1 FP4 cache) may come
    with ``rows``, a contiguous ``[num_tokens]`` int32 buffer the same launch fills with
    each slot's record r, or -1 for a slot outside the cache: the token slots a paged call reads the
    records by.

    A valid call's verdict is memoised under its tensors' signatures and its other arguments (as the
    contract's), so a serving loop's repeated calls pay the signatures and one lookup."""
    try:
        key = (
            type(page_size),
            page_size,
            type(extra_rows),
            extra_rows,
            type(layout),
            layout,
            out_dtype,
            signature(cache),
            signature(slot_ids),
            None if out is None else signature(out),
            None if rows is None else signature(rows),
        )
        verdict = _memo.get(key)
    except TypeError:  # an unhashable argument: the checks say what is wrong with it
        key = verdict = None
    if verdict is None:
        verdict = _check_gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out, rows)
        if key is not None:
            checks.remember(_memo, key, verdict, _MEMO_ENTRIES)
    layout, page_shape, page_strides, shape = verdict
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=cache.device)
    if shape[0] == 0:
        return out
    words = slot_words(slot_ids)
    if words.shape[0] == 0 or page_shape[0] == 0:  # nothing to read: only zero rows
        out.zero_()
        if out.dtype == RECORDS:  # their scales 2^0, as the kernel writes a zero row's
            out[:, layout.d_qk :] = 127
            if rows is not None:
                rows.fill_(-1)
        return out
    if out.dtype == RECORDS and rows is None:  # the kernel writes them
        rows = torch.empty(words.shape[0], dtype=torch.int32, device=cache.device)
    pages = cache.view(torch.uint8).as_strided(page_shape, page_strides)
    kernels.launch_paged_kv_gather(pages, words, out, page_size, layout.name, rows)
    return out


_MEMO_ENTRIES = 64
_memo: dict[tuple, tuple] = checks.memo()


def _check_gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out, rows) -> tuple:
    """``gather_dequant_paged``'s checks: ``(layout, the pages view's shape and strides, out's shape)``."""
    layout = get_layout(layout)
    out_dtype = out_dtype_of(out_dtype, layout)
    extra_rows = require_int("extra_rows", extra_rows, 0)
    pages = paged_cache_pages(cache, page_size, layout)
    require_aligned_pages("cache", pages.data_ptr(), pages.shape[0], pages.stride(0))
    words = slot_words(slot_ids)
    shape = out_shape(layout, words.shape[0] + extra_rows, out_dtype)
    if out is not None:
        check_buffer("out", out, shape, out_dtype)
        if out.data_ptr() % 16:
            raise ValueError("out: expected a 16-byte aligned buffer (rows are written 16 bytes at a time)")
        if overlaps(out, pages):
            raise ValueError("out: expected memory of its own, got memory overlapping cache")
    if rows is not None:
        if out_dtype != RECORDS:
            raise ValueError("rows: expected None unless out_dtype is torch.uint8 (V4.1 records)")
        check_buffer("rows", rows, (words.shape[0],), torch.int32)
        for name, tensor in (("cache", pages), ("slot_ids", slot_ids), ("out", out)):
            if tensor is not None and overlaps(rows, tensor):
                raise ValueError(f"rows: expected memory of its own, got memory overlapping {name}")
    _check_devices(cache, slot_ids, out, rows)  # last: every other check reports the same way without a GPU
    return layout, tuple(pages.shape), pages.stride(), shape


def _check_devices(cache, slot_ids, out, rows) -> None:
    if cache.device.type != "cuda":
        raise ValueError(f"cache: expected a CUDA tensor, got device {cache.device}")
    for name, tensor in (("slot_ids", slot_ids), ("out", out), ("rows", rows)):
        if tensor is not None and tensor.device != cache.device:
            raise ValueError(
                f"{name}: expected a tensor on {cache.device} (the cache's device), got {tensor.device}"
            )


def gather_dequant_requant_fp8_paged(
    cache_u8: torch.Tensor,
    slot_ids: torch.Tensor,
    page_size: int,
    layout,
    extra_rows: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather, dequantise and requantise token slots of a paged FP8 cache, on the GPU (one kernel).

    Args:
        cache_u8: the paged cache, uint8 (or a float8_e4m3fn view), ``[num_pages, ...]`` with each
            page's bytes contiguous (e.g. ``[num_pages, page_size, 1, bytes_per_token]``); base and
            page stride 16-byte aligned.
        slot_ids: ``[num_tokens]`` int32 or int64 physical slots; slot ``s`` is position
            ``s % page_size`` of page ``s // page_size``. A slot outside ``[0, num_pages * page_size)``
            gives a zero row and is never read.
        page_size: tokens per page.
        layout: "model1" (DeepSeek V4, d_qk 512), "v32" (DeepSeek V3.2, d_qk 576), "v41" or "v41_fp4"
            (DeepSeek V4.1, d_qk 512), or a ``q8kv8.kv_layout.KvCacheLayout``.
        extra_rows: zero rows appended after the gathered ones (a landing zone).
        out: optional ``[num_tokens + extra_rows, 1, d_qk]`` float8_e4m3fn contiguous buffer, reused
            (its extra rows are re-zeroed).

    Returns ``out``: e4m3 rows with a per-tensor scale of 1.0: each nope value times its block scale
    (in float32), rounded to nearest even into e4m3 saturating at +-448, then the RoPE values rounded
    the same way from bf16. Bit-exact with ``gather_dequant_paged_reference``. No host sync.
    """
    return gather_dequant_paged(cache_u8, slot_ids, page_size, layout, torch.float8_e4m3fn, extra_rows, out)
