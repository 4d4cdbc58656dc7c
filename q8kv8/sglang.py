"""SGLang's names and signatures for the serving helpers around ``sparse_mla_q8kv8_prefill_fwd``.

An engine written against SGLang's ``sparse_mla_q8kv8_prefill_fwd`` and its DeepSeek V4 helpers
(``q8kv8_padded_num_heads``, ``cast_q_fp8_for_q8kv8_prefill``, ``gather_dequant_requant_fp8_paged``) can
import these instead; each is built on q8kv8's own function and keeps SGLang's arguments and results:

- ``q8kv8_padded_num_heads(num_heads)``: ``num_heads`` rounded up to a multiple of 64, the head count of
  the head-padded buffers SGLang's wrapper passes (q8kv8 also takes any head count unpadded).
- ``cast_q_fp8_for_q8kv8_prefill(q, padded_num_heads=None, out=None) -> (q_fp8, q_scale)``: Q cast to e4m3
  with scale 1.0 (rounded to nearest even, saturating at +-448) into a head-padded buffer whose padding
  heads are zero; ``q_scale`` is a 0-d float32 one.
- ``gather_dequant_requant_fp8_paged(quant_k_cache, page_table_1_flattened, page_size, extra_rows=0,
  out=None)``: ``q8kv8.gather_dequant_requant_fp8_paged`` with the cache layout read from its bytes per
  token (``paged_kv_layout``), so one call serves DeepSeek V4 (584 bytes per token), V3.2 (656) and V4.1
  (528; its FP4 extra cache 288) caches.

``sparse_mla_q8kv8_prefill_fwd`` itself is re-exported unchanged: its argument errors are ValueErrors
(a wrong type or dtype raises ``q8kv8.InputTypeError``, both a TypeError and a ValueError) whose messages
carry SGLang's phrases.
"""

from __future__ import annotations

import numbers

import torch

from q8kv8.api import sparse_mla_q8kv8_prefill_fwd
from q8kv8.contract import InputTypeError
from q8kv8.kv_layout import LAYOUT_BY_BYTES_PER_TOKEN, MODEL1, V32, V41, V41_FP4, KvCacheLayout
from q8kv8.metadata import E4M3_MAX, HEAD_ALIGNMENT, padded_num_heads
from q8kv8.paged_gather import gather_dequant_requant_fp8_paged as _gather
from q8kv8.query import cast_q_fp8

__all__ = [
    "cast_q_fp8_for_q8kv8_prefill",
    "gather_dequant_requant_fp8_paged",
    "paged_kv_layout",
    "q8kv8_padded_num_heads",
    "sparse_mla_q8kv8_prefill_fwd",
]

FP8 = torch.float8_e4m3fn


def q8kv8_padded_num_heads(num_heads: int) -> int:
    """``num_heads`` rounded up to a multiple of 64 (a tile's heads); ValueError unless positive."""
    if isinstance(num_heads, bool) or not isinstance(num_heads, numbers.Integral) or num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads!r}")
    return padded_num_heads(int(num_heads))


def cast_q_fp8_for_q8kv8_prefill(
    q: torch.Tensor, padded_num_heads: int | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ([num_tokens, num_heads, d], a float dtype) cast to e4m3 with scale 1.0 into
    ``[num_tokens, padded_num_heads, d]`` (default ``q8kv8_padded_num_heads(num_heads)``; any multiple of 64
    >= num_heads), padding heads zero; returns ``(q_fp8, q_scale)`` with ``q_scale`` a 0-d float32 1.0 on q's
    device. ``out``: an optional buffer of that shape, dtype float8_e4m3fn, on q's device, contiguous.
    bfloat16 on a GPU runs q8kv8's cast kernel; other float dtypes and CPU tensors cast in PyTorch (the
    same rounding). No host sync."""
    if not isinstance(q, torch.Tensor) or not q.is_floating_point() or q.dtype == FP8:
        raise InputTypeError(f"q must be a floating-point tensor to cast, got {getattr(q, 'dtype', type(q))}")
    if q.dim() != 3:
        raise ValueError(f"q must have shape (num_tokens, num_heads, head_dim), got {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    natural = q8kv8_padded_num_heads(num_heads)
    if padded_num_heads is None:
        padded_num_heads = natural
    if (
        isinstance(padded_num_heads, bool)
        or not isinstance(padded_num_heads, numbers.Integral)
        or padded_num_heads < num_heads
        or padded_num_heads % HEAD_ALIGNMENT
    ):
        raise ValueError(
            f"invalid padded_num_heads={padded_num_heads} for num_heads={num_heads}: expected a multiple "
            f"of {HEAD_ALIGNMENT} >= num_heads"
        )
    shape = (num_tokens, int(padded_num_heads), head_dim)
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != shape
        or out.dtype != FP8
        or out.device != q.device
        or not out.is_contiguous()
    ):
        got = (
            f"{tuple(out.shape)}/{out.dtype}/{out.device}"
            if isinstance(out, torch.Tensor)
            else type(out).__name__
        )
        raise ValueError(f"Q8KV8 Q output must have shape/dtype/device {shape}/{FP8}/{q.device}, got {got}")
    q_scale = torch.ones((), dtype=torch.float32, device=q.device)
    if q.dtype == torch.bfloat16 and q.is_cuda and head_dim % 16 == 0 and padded_num_heads == natural:
        return cast_q_fp8(q, q_scale, out), q_scale
    if out is None:
        out = torch.empty(shape, dtype=FP8, device=q.device)
    out[:, :num_heads].copy_(q.float().clamp_(-E4M3_MAX, E4M3_MAX))
    out[:, num_heads:].zero_()
    return out, q_scale


# the layouts whose token records lie back to back (no page-level scale region or padding)
_RECORD_LAYOUTS = frozenset(layout.bytes_per_token for layout in (V32, V41, V41_FP4))


def paged_kv_layout(cache: torch.Tensor, page_size: int) -> tuple[torch.Tensor, int, KvCacheLayout]:
    """``(pages, page_size, layout)`` for ``q8kv8.gather_dequant_requant_fp8_paged``, read from the cache's
    bytes per token (any dtype: its bytes are read as uint8):

    - ``[num_pages, page_size, 1, bytes_per_token]`` (the FlashMLA / SGLang decode view) or
      ``[num_tokens, 1, bytes_per_token]``: the last dim is the bytes per token, 584 (DeepSeek V4), 656
      (V3.2), 528 (V4.1) or 288 (V4.1 FP4);
    - ``[num_pages, bytes_per_page]`` (SGLang's V4 pool): ``bytes_per_page // page_size`` bytes per token,
      584 to 655 for V4 (its pages are padded to a multiple of 576 bytes), exactly 656, 528 or 288 for
      V3.2, V4.1 and V4.1 FP4; a last dim of exactly 656, 528 or 288 is token records.

    V3.2's and V4.1's token records lie back to back, so such a cache is read as one record per slot (page
    size 1) whenever its records are contiguous."""
    if not isinstance(cache, torch.Tensor):
        raise InputTypeError(f"quant_k_cache must be a torch.Tensor, got {type(cache).__name__}")
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 1:
        raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
    raw = cache.view(torch.uint8) if cache.dtype != torch.uint8 else cache
    if raw.dim() < 2:
        raise ValueError(f"quant_k_cache must be at least 2-D, got shape {tuple(cache.shape)}")
    last = raw.shape[-1]
    if raw.dim() >= 3 and last in LAYOUT_BY_BYTES_PER_TOKEN:
        layout = LAYOUT_BY_BYTES_PER_TOKEN[last]
        if layout is MODEL1 and raw.shape[1] != page_size:
            raise ValueError(
                f"quant_k_cache: a [num_pages, page_size, 1, 584] cache needs shape[1] == page_size "
                f"({page_size}), got shape {tuple(cache.shape)}"
            )
    elif raw.dim() == 2 and last in _RECORD_LAYOUTS:
        layout = LAYOUT_BY_BYTES_PER_TOKEN[last]
    elif raw.dim() == 2:
        bytes_per_token = last // page_size
        if MODEL1.bytes_per_token <= bytes_per_token < V32.bytes_per_token:
            layout = MODEL1
        elif bytes_per_token in _RECORD_LAYOUTS and last == bytes_per_token * page_size:
            layout = LAYOUT_BY_BYTES_PER_TOKEN[bytes_per_token]
        else:
            raise ValueError(
                f"quant_k_cache: {last} bytes per page for page_size {page_size} is {bytes_per_token} bytes "
                f"per token; expected 584-655 (DeepSeek V4), 656 (V3.2), 528 (V4.1) or 288 (V4.1 FP4)"
            )
    else:
        raise ValueError(
            f"quant_k_cache: expected [num_pages, page_size, 1, bytes_per_token] with bytes_per_token 584 "
            f"(DeepSeek V4), 656 (V3.2), 528 (V4.1) or 288 (V4.1 FP4), or [num_pages, bytes_per_page], got "
            f"shape {tuple(cache.shape)}"
        )
    if layout.bytes_per_token in _RECORD_LAYOUTS and raw.is_contiguous():
        return raw.view(-1, layout.bytes_per_token), 1, layout
    return raw, int(page_size), layout


def gather_dequant_requant_fp8_paged(
    quant_k_cache: torch.Tensor,
    page_table_1_flattened: torch.Tensor,
    page_size: int,
    extra_rows: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather the slots ``page_table_1_flattened`` ([num_tokens] int32/int64) of a paged FP8 cache into
    ``[num_tokens + extra_rows, 1, d_qk]`` e4m3 rows with a per-tensor scale of 1.0 (d_qk 512 for a V4 or V4.1
    cache, 576 for V3.2; the layout from ``paged_kv_layout``); ``extra_rows`` zero rows follow. ``out``: an
    optional contiguous buffer of that shape, fully written. A slot outside the cache gives a zero row and
    is never read. One kernel on the GPU, no host sync (``q8kv8.gather_dequant_requant_fp8_paged``)."""
    pages, page_size, layout = paged_kv_layout(quant_k_cache, page_size)
    return _gather(pages, page_table_1_flattened, page_size, layout, extra_rows, out)
