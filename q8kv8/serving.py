"""The paged serving path: a paged FP8 KV cache in, one sparse-prefill layer call out.

``SparsePrefill.forward`` = ``cast_q_fp8`` (Q to e4m3, heads padded to a multiple of 64) +
``gather_dequant_requant_fp8_paged`` (the rows a batch attends, from the paged cache into a
reusable ``SparsePrefillWorkspace``) + ``sparse_mla_q8kv8_prefill_fwd`` + slicing the padded heads
off. The cache layouts are described in ``q8kv8.kv_layout`` and ``cute_kernels/paged_kv.py``.

Nothing here syncs with the GPU: arguments are checked on shapes, dtypes, strides and devices
only, so a forward can be captured in a CUDA graph once the kernels are built (the gather and
query-cast kernels build on first use, then come from the disk cache: call
``q8kv8.kernels.load_serving_variants()`` or run one forward before capturing).
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from q8kv8.contract import _overlaps
from q8kv8.kv_layout import LAYOUT_BY_BYTES_PER_TOKEN, V32, KvCacheLayout, get_layout
from q8kv8.metadata import D_V, E4M3_MAX, pad_topk, padded_num_heads, topk_length_from_seqlens

BACKENDS = ("auto", "bf16", "fp8")
BACKEND_ENV = "Q8KV8_PREFILL_BACKEND"
COMPRESS_RATIOS = (0, 4, 128)
_CAST_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of cast_q_fp8: at most 64 MiB


# ------------------------------------------------------------------------------------------------
# Paged cache views (shared by the kernel wrapper and the torch reference)
# ------------------------------------------------------------------------------------------------
def _require_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def paged_cache_pages(cache: torch.Tensor, page_size: int, layout) -> torch.Tensor:
    """``cache`` as ``[num_pages, page_bytes]`` uint8 (a view, no copy), checked against ``layout``.

    ``cache``: uint8 (or a float8_e4m3fn view of the same bytes), at least 2-D, the first dim the
    pages, the other dims contiguous inside a page (any page stride); each page must hold the
    ``page_size * bytes_per_token`` bytes the layout reads.
    """
    layout = get_layout(layout)
    page_size = _require_int("page_size", page_size, 1)
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


def _out_dtype_of(out_dtype) -> torch.dtype:
    if out_dtype not in (torch.float8_e4m3fn, torch.bfloat16):
        raise TypeError(f"out_dtype: expected torch.float8_e4m3fn or torch.bfloat16, got {out_dtype}")
    return out_dtype


# ------------------------------------------------------------------------------------------------
# Gather: paged cache -> contiguous rows (CuTe DSL kernel, and its bit-exact torch reference)
# ------------------------------------------------------------------------------------------------
def gather_dequant_paged(
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    page_size: int,
    layout,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    extra_rows: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather token slots of a paged FP8 cache into contiguous ``[num_tokens + extra_rows, 1, d_qk]``
    rows of ``out_dtype`` (e4m3 with per-tensor scale 1.0, or bf16) on the GPU; see
    ``gather_dequant_requant_fp8_paged``. The bf16 rows hold the dequantised nope (rounded to bf16)
    and the RoPE values unchanged."""
    layout = get_layout(layout)
    out_dtype = _out_dtype_of(out_dtype)
    extra_rows = _require_int("extra_rows", extra_rows, 0)
    pages = paged_cache_pages(cache, page_size, layout)
    if pages.data_ptr() % 16 or (pages.shape[0] > 1 and pages.stride(0) % 16):
        raise ValueError(
            f"cache: expected a 16-byte aligned base and page stride (rows are read 16 bytes at a time), "
            f"got page stride {pages.stride(0)} bytes"
        )
    words = slot_words(slot_ids)
    rows = words.shape[0] + extra_rows
    shape = (rows, 1, layout.d_qk)
    if out is not None:
        _padded_buffer_check("out", out, shape, out_dtype)
        if out.data_ptr() % 16:
            raise ValueError("out: expected a 16-byte aligned buffer (rows are written 16 bytes at a time)")
        if _overlaps(out, pages):
            raise ValueError("out: expected memory of its own, got memory overlapping cache")
    # Devices last, so that every other check reports the same way on a machine without a GPU.
    if cache.device.type != "cuda":
        raise ValueError(f"cache: expected a CUDA tensor, got device {cache.device}")
    for name, tensor in (("slot_ids", slot_ids), ("out", out)):
        if tensor is not None and tensor.device != cache.device:
            raise ValueError(
                f"{name}: expected a tensor on {cache.device} (the cache's device), got {tensor.device}"
            )
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=cache.device)
    if rows == 0:
        return out
    if words.shape[0] == 0 or pages.shape[0] == 0:  # nothing to read: only zero rows
        return out.zero_()
    from q8kv8 import kernels

    kernels.launch_paged_kv_gather(pages, words, out, page_size, layout.name)
    return out


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
        layout: "model1" (DeepSeek V4, d_qk 512) or "v32" (DeepSeek V3.2, d_qk 576), or a
            ``q8kv8.kv_layout.KvCacheLayout``.
        extra_rows: zero rows appended after the gathered ones (a landing zone).
        out: optional ``[num_tokens + extra_rows, 1, d_qk]`` float8_e4m3fn contiguous buffer, reused
            (its extra rows are re-zeroed).

    Returns ``out``: e4m3 rows with a per-tensor scale of 1.0: each nope value times its block scale
    (in float32), rounded to nearest even into e4m3 saturating at +-448, then the RoPE values rounded
    the same way from bf16. Bit-exact with ``gather_dequant_paged_reference``. No host sync.
    """
    return gather_dequant_paged(cache_u8, slot_ids, page_size, layout, torch.float8_e4m3fn, extra_rows, out)


def gather_dequant_paged_reference(
    cache: torch.Tensor,
    slot_ids: torch.Tensor,
    page_size: int,
    layout,
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    extra_rows: int = 0,
) -> torch.Tensor:
    """The gather in plain PyTorch (CPU or GPU), bit-exact with the kernel: same arguments, new output."""
    layout = get_layout(layout)
    out_dtype = _out_dtype_of(out_dtype)
    extra_rows = _require_int("extra_rows", extra_rows, 0)
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

    data = take(pos * layout.token_bytes, layout.token_bytes)
    nope = data[:, : layout.d_nope].view(torch.float8_e4m3fn).float()
    rope = (
        data[:, layout.rope_offset : layout.rope_offset + 2 * layout.d_rope].contiguous().view(torch.bfloat16)
    )
    if layout.scale_offset is not None:
        scale_bytes = data[:, layout.scale_offset : layout.scale_offset + 4 * layout.num_scales].contiguous()
        scales = scale_bytes.view(torch.float32)
    else:
        record = layout.scale_region_offset(page_size) + pos * (layout.bytes_per_token - layout.token_bytes)
        scales = take(record, layout.num_scales).view(torch.float8_e8m0fnu).float()
    dequant = (nope.view(num_tokens, layout.num_scales, layout.scale_group) * scales[:, :, None]).flatten(1)
    if out_dtype == torch.bfloat16:
        row = torch.cat([dequant.to(torch.bfloat16), rope], dim=1)
    else:
        row = torch.cat([dequant, rope.float()], dim=1).clamp(-E4M3_MAX, E4M3_MAX)
    row = torch.where(valid[:, None], row, torch.zeros((), dtype=row.dtype, device=row.device))
    out = torch.zeros(num_tokens + extra_rows, 1, layout.d_qk, dtype=out_dtype, device=pages.device)
    out[:num_tokens, 0] = row.to(out_dtype)
    return out


# ------------------------------------------------------------------------------------------------
# Query side
# ------------------------------------------------------------------------------------------------
def _padded_buffer_check(name, out, shape, dtype):
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(out.stride())}")


def cast_q_fp8(q_bf16: torch.Tensor, q_scale, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q / q_scale`` in float32, rounded to nearest even into e4m3 (saturating at +-448), in a
    head-padded buffer ``[s_q, padded_num_heads(h), d]`` whose padding heads are zero.

    ``q_bf16``: [s_q, h, d] bfloat16, d a multiple of 16. ``q_scale``: a one-element float32 tensor
    on q's device (read there: no sync) or a positive Python number. ``out``: optional contiguous
    buffer of that shape, reused. On a GPU one CuTe DSL kernel (``cute_kernels/q_cast.py``) does it;
    on CPU PyTorch does, bit-exactly the same.
    """
    if not isinstance(q_bf16, torch.Tensor) or q_bf16.dtype != torch.bfloat16:
        raise TypeError(
            f"q: expected a torch.bfloat16 tensor, got {getattr(q_bf16, 'dtype', type(q_bf16).__name__)}"
        )
    if q_bf16.dim() != 3 or q_bf16.shape[2] % 16:
        raise ValueError(
            f"q: expected a 3-D tensor [s_q, h, d] with d % 16 == 0, got shape {list(q_bf16.shape)}"
        )
    s_q, h, d = q_bf16.shape
    shape = (s_q, padded_num_heads(h), d)
    if isinstance(q_scale, torch.Tensor):
        if q_scale.dtype != torch.float32 or q_scale.numel() != 1:
            raise ValueError(
                f"q_scale: expected a one-element float32 tensor, got {q_scale.dtype} {list(q_scale.shape)}"
            )
        divisor = q_scale.reshape(1)
    else:
        if isinstance(q_scale, bool) or not isinstance(q_scale, numbers.Real) or not q_scale > 0:
            raise ValueError(f"q_scale: expected a positive number or a float32 tensor, got {q_scale!r}")
        divisor = torch.tensor([float(q_scale)], dtype=torch.float32, device=q_bf16.device)
    if out is not None:
        _padded_buffer_check("out", out, shape, torch.float8_e4m3fn)
        if _overlaps(out, q_bf16):
            raise ValueError("out: expected memory of its own, got memory overlapping q")
    for name, tensor in (("q_scale", divisor), ("out", out)):
        if tensor is not None and tensor.device != q_bf16.device:
            raise ValueError(
                f"{name}: expected a tensor on {q_bf16.device} (the device of q), got {tensor.device}"
            )
    if out is None:
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=q_bf16.device)
    if q_bf16.is_cuda:
        if s_q:
            if (
                q_bf16.data_ptr() % 16
                or q_bf16.stride(2) != 1
                or q_bf16.stride(0) % 8
                or q_bf16.stride(1) % 8
            ):
                q_bf16 = q_bf16.clone(memory_format=torch.contiguous_format)  # read in 16-byte chunks
            if out.data_ptr() % 16:
                raise ValueError("out: expected a 16-byte aligned buffer")
            from q8kv8 import kernels

            kernels.launch_cast_q_fp8(q_bf16, divisor, out)
        return out
    out[:, h:].zero_()
    rows = max(1, _CAST_CHUNK_ELEMENTS // max(1, h * d))
    for start in range(0, s_q, rows):
        chunk = torch.div(q_bf16[start : start + rows], divisor)  # float32: the 1-D divisor promotes
        out[start : start + rows, :h].copy_(chunk.clamp_(-E4M3_MAX, E4M3_MAX))
    return out


def dynamic_q_scale(q: torch.Tensor) -> torch.Tensor:
    """A power-of-two per-tensor scale for ``q`` (one-element float32 on q's device, no sync): the
    smallest 2^k >= max|q| / 448, so ``q / scale`` is exact in float32 and never saturates."""
    amax = q.detach().abs().amax().float() if q.numel() else q.new_zeros((), dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / E4M3_MAX, tiny)))).reshape(1)


def pad_attn_sink(attn_sink: torch.Tensor, num_heads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``attn_sink`` ([h] float32) extended to ``num_heads`` with -inf (padding heads have no sink)."""
    if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32 or attn_sink.dim() != 1:
        raise TypeError("attn_sink: expected a 1-D float32 tensor [h]")
    h = attn_sink.shape[0]
    if num_heads < h:
        raise ValueError(f"num_heads: expected at least {h} (the sink's heads), got {num_heads}")
    if out is None:
        out = torch.empty(num_heads, dtype=torch.float32, device=attn_sink.device)
    else:
        _padded_buffer_check("out", out, (num_heads,), torch.float32)
    out[:h].copy_(attn_sink)
    out[h:].fill_(-math.inf)
    return out


def pad_q_heads(q: torch.Tensor, num_heads: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` ([s_q, h, d]) extended to ``num_heads`` heads with zeros, same dtype."""
    s_q, h, d = q.shape
    if out is None:
        out = torch.empty((s_q, num_heads, d), dtype=q.dtype, device=q.device)
    else:
        _padded_buffer_check("out", out, (s_q, num_heads, d), q.dtype)
    out[:, :h].copy_(q)
    out[:, h:].zero_()
    return out


# ------------------------------------------------------------------------------------------------
# Workspace
# ------------------------------------------------------------------------------------------------
def indexed_device(device) -> torch.device:
    """``device`` as the ``torch.device`` a tensor allocated there reports: a CUDA device given without an
    index ("cuda") is the current CUDA device, where torch allocates it."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _ReusableBuffer:
    """One flat buffer handed out as views; reallocated only when the dtype, device or size does not fit."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    def view(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self.buffer
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.device != indexed_device(device)
            or buffer.numel() < numel
        ):
            self.buffer = buffer = None  # free the old buffer before allocating the new one
            buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self.buffer = buffer
            self.allocations += 1
        return buffer[:numel].view(shape)


class SparsePrefillWorkspace:
    """Owns the gathered-KV workspace: one buffer, handed out as ``[num_tokens, 1, d_qk]`` views.

    ``get`` reallocates only when the requested rows do not fit the buffer or the dtype differs, so a
    smaller request after a larger one returns a view of the same memory (CUDA-graph friendly: the
    pointer is stable once the largest size has been seen; ``reserve`` that size up front).
    """

    def __init__(self, device=None, d_qk: int = V32.d_qk):
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        self.d_qk = d_qk
        self._kv = _ReusableBuffer()

    @property
    def allocations(self) -> int:
        return self._kv.allocations

    @property
    def capacity_bytes(self) -> int:
        buffer = self._kv.buffer
        return 0 if buffer is None else buffer.numel() * buffer.element_size()

    def get(self, num_tokens: int, dtype: torch.dtype, d_qk: int | None = None) -> torch.Tensor:
        """A ``[num_tokens, 1, d_qk]`` view of ``dtype`` (float8_e4m3fn or bfloat16) of the workspace."""
        num_tokens = _require_int("num_tokens", num_tokens, 0)
        _out_dtype_of(dtype)
        d_qk = self.d_qk if d_qk is None else d_qk
        return self._kv.view((num_tokens, 1, d_qk), dtype, self.device)

    def reserve(self, num_tokens: int, dtype: torch.dtype, d_qk: int | None = None) -> None:
        self.get(num_tokens, dtype, d_qk)


# ------------------------------------------------------------------------------------------------
# The layer call
# ------------------------------------------------------------------------------------------------
class PrefillKernels(NamedTuple):
    """The device kernels ``SparsePrefill`` calls (injectable: the tests run the pipeline on CPU with
    ``reference_kernels()``).

    - ``gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out) -> out``
    - ``attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length)``
      -> ``(out, max_logits, lse)``: the ``sparse_mla_q8kv8_prefill_fwd`` contract.
    - ``attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length) -> (out, max_logits, lse)``:
      q [s_q, h, d_qk] and kv [s_kv, 1, d_qk] bfloat16, the same semantics without scales.
    """

    gather: Callable
    attention_fp8: Callable
    attention_bf16: Callable


def _cuda_attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length):
    from q8kv8.api import sparse_mla_q8kv8_prefill_fwd

    return sparse_mla_q8kv8_prefill_fwd(
        q, kv, indices, sm_scale, q_scale, kv_scale, D_V, attn_sink, topk_length
    )


def _cuda_attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length):
    """The bf16 kernel (``cute_kernels/sm90/sparse_prefill_bf16.py``) through
    ``q8kv8.kernels.launch_sparse_prefill_bf16(q, kv, indices, topk_length, attn_sink, sm_scale, out,
    max_logits, lse)``: q [s_q, h, d_qk] bf16 row-major with h a multiple of 64, kv [s_kv, 1, d_qk] bf16,
    indices [s_q, 1, topk] int32 (topk a multiple of 128), topk_length [s_q] int32 or None, attn_sink
    [h] float32 or None, out [s_q, h, 512] bf16, max_logits and lse [s_q, h] float32.
    """
    from q8kv8 import kernels

    launch = kernels.launch_sparse_prefill_bf16
    s_q, h, _ = q.shape
    out = torch.empty((s_q, h, D_V), dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty((s_q, h), dtype=torch.float32, device=q.device)
    lse = torch.empty((s_q, h), dtype=torch.float32, device=q.device)
    if s_q:
        if kv.shape[0] == 0:
            out.zero_()
            max_logits.fill_(-math.inf)
            lse.fill_(math.inf)
        else:
            launch(q, kv, indices, topk_length, attn_sink, float(sm_scale), out, max_logits, lse)
    return out, max_logits, lse


def cuda_kernels() -> PrefillKernels:
    """The GPU kernels: the CuTe DSL gather and the FP8 (and, once it lands, bf16) attention."""
    return PrefillKernels(gather_dequant_paged, _cuda_attention_fp8, _cuda_attention_bf16)


def _reference_attention_fp8(q, kv, indices, sm_scale, q_scale, kv_scale, attn_sink, topk_length):
    from q8kv8.reference import sparse_mla_prefill_reference

    out, max_logits, lse = sparse_mla_prefill_reference(
        q, kv, indices, sm_scale, q_scale, kv_scale, D_V, attn_sink, topk_length
    )
    return out.to(torch.bfloat16), max_logits.float(), lse.float()


def _reference_attention_bf16(q, kv, indices, sm_scale, attn_sink, topk_length):
    return _reference_attention_fp8(q, kv, indices, sm_scale, 1.0, 1.0, attn_sink, topk_length)


def reference_kernels() -> PrefillKernels:
    """PyTorch stand-ins for the GPU kernels (CPU or GPU): the bit-exact gather reference and the
    float64 attention reference (outputs cast to the kernels' dtypes)."""

    def gather(cache, slot_ids, page_size, layout, out_dtype, extra_rows, out):
        result = gather_dequant_paged_reference(cache, slot_ids, page_size, layout, out_dtype, extra_rows)
        if out is None:
            return result
        out.copy_(result)
        return out

    return PrefillKernels(gather, _reference_attention_fp8, _reference_attention_bf16)


def resolve_backend(backend: str = "auto") -> str:
    """The backend a ``SparsePrefill`` runs: ``$Q8KV8_PREFILL_BACKEND`` when set, else ``backend``;
    "auto" resolves to "fp8" (the SM90 FP8 kernel)."""
    requested = os.environ.get(BACKEND_ENV) or backend
    if requested not in BACKENDS:
        source = f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "backend"
        raise ValueError(f"{source}: expected one of {BACKENDS}, got {requested!r}")
    return "fp8" if requested == "auto" else requested


def paged_cache_geometry(cache: torch.Tensor) -> tuple[KvCacheLayout, int]:
    """``(layout, page_size)`` of a cache given as ``[num_pages, page_size, 1, bytes_per_token]``
    (bytes_per_token 656: V3.2, 584: MODEL1), the shape FlashMLA and SGLang use."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cache: expected a torch.Tensor, got {type(cache).__name__}")
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] not in LAYOUT_BY_BYTES_PER_TOKEN:
        raise ValueError(
            f"cache: expected shape [num_pages, page_size, 1, bytes_per_token] with bytes_per_token in "
            f"{sorted(LAYOUT_BY_BYTES_PER_TOKEN)} (584: MODEL1, 656: V3.2), got {list(cache.shape)}"
        )
    if cache.shape[1] < 1:
        raise ValueError(f"cache: expected page_size = cache.shape[1] >= 1, got {cache.shape[1]}")
    return LAYOUT_BY_BYTES_PER_TOKEN[cache.shape[3]], cache.shape[1]


def topk_length_for(seqlens: torch.Tensor, compress_ratio: int, topk: int) -> torch.Tensor:
    """Valid leading index slots per query: ``min(visible rows, topk)`` where a query whose request
    holds ``seqlens[i]`` tokens up to and including itself (its absolute position + 1) sees
    ``seqlens[i]`` rows of the uncompressed cache (ratio 0) or ``seqlens[i] // r`` compressed rows
    (ratio r: row c summarises tokens [c r, (c + 1) r), complete once token (c + 1) r - 1 exists)."""
    if compress_ratio not in COMPRESS_RATIOS:
        raise ValueError(f"compress_ratio: expected one of {COMPRESS_RATIOS}, got {compress_ratio!r}")
    visible = seqlens if compress_ratio == 0 else torch.div(seqlens, compress_ratio, rounding_mode="floor")
    return topk_length_from_seqlens(visible, topk)


class SparsePrefill:
    """One sparse MLA prefill layer call on a paged FP8 KV cache (DeepSeek V3.2 / V4 serving).

    ``backend``: "fp8" (Q and the gathered KV in e4m3, the FP8 kernel), "bf16" (Q and the gathered KV
    in bf16: dequantised nope rounded to bf16 + RoPE; the bf16 kernel), or "auto" (fp8). The
    environment variable ``Q8KV8_PREFILL_BACKEND`` overrides it. ``extra_rows`` zero rows follow the
    gathered rows in the workspace (a landing zone); they are never attended. ``kernels`` replaces the
    GPU kernels (``reference_kernels()`` runs the pipeline in PyTorch).
    """

    def __init__(
        self,
        backend: str = "auto",
        *,
        extra_rows: int = 0,
        workspace: SparsePrefillWorkspace | None = None,
        kernels: PrefillKernels | None = None,
    ):
        self.backend = resolve_backend(backend)
        self.extra_rows = _require_int("extra_rows", extra_rows, 0)
        self.workspace = workspace
        self.kernels = kernels if kernels is not None else cuda_kernels()
        self._q = _ReusableBuffer()
        self._sink = _ReusableBuffer()
        self._ones: dict[torch.device, torch.Tensor] = {}

    def forward(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        page_table: torch.Tensor,
        indices: torch.Tensor,
        seqlens: torch.Tensor,
        compress_ratio: int,
        sm_scale: float,
        attn_sink: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Attend each query to the rows its ``indices`` select; returns ``(out, max_logits, lse)``.

        Args:
            q: [s_q, h, d_qk] bfloat16, the queries of every request of the batch, concatenated;
                d_qk 576 (V3.2) or 512 (MODEL1), matching the cache.
            cache: [num_pages, page_size, 1, bytes_per_token] uint8 or float8_e4m3fn paged cache
                (bytes_per_token 656: V3.2, 584: MODEL1; page stride = ``cache.stride(0)`` bytes, e.g.
                the 576-byte-padded MODEL1 page). For ``compress_ratio`` r > 0 this is the compressed
                cache (one entry per r tokens), with the same layout.
            page_table: [num_rows] int32/int64: the cache slots the batch may attend, in workspace
                order (SGLang's ``page_table_1_flattened``: each request's slots of its tokens, or of
                its compressed rows for r > 0, requests concatenated). Slot s is position
                ``s % page_size`` of page ``s // page_size``. They are gathered into workspace rows
                ``0 .. num_rows - 1``.
            indices: [s_q, topk] or [s_q, 1, topk] int32: workspace rows (indices into
                ``page_table``) each query attends, valid ones first (SGLang's "ragged" top-k, i.e.
                the request-local top-k index plus the request's first row). Entries outside
                ``[0, num_rows)`` (-1 padding) and slots past the query's ``topk_length`` are
                ignored. Any topk >= 1 (padded to a multiple of 128 with -1 here).
            seqlens: [s_q] integer: the number of tokens of the query's request up to and including
                the query, i.e. its absolute position + 1 (SGLang's ``seqlens_expanded``), in tokens
                for every compress ratio.
            compress_ratio: 0 (uncompressed cache), 4 or 128. The query sees
                ``seqlens // compress_ratio`` compressed rows (all of them for 0: ``seqlens``), and
                ``topk_length = min(that, topk)`` of its leading index slots count.
            sm_scale: softmax scale.
            attn_sink: optional [h] float32 per-head sink.

        Returns ``out`` [s_q, h, 512] bfloat16, ``max_logits`` and ``lse`` [s_q, h] float32 (the
        contract of ``sparse_mla_q8kv8_prefill_fwd``; views of head-padded results when h is not a
        multiple of 64). The FP8 backend quantises Q with a power-of-two per-tensor scale
        (``dynamic_q_scale``) and the KV rows with scale 1.0 after dequantisation.
        """
        layout, page_size = paged_cache_geometry(cache)
        s_q, h, d_qk = self._check(q, cache, layout, page_table, indices, seqlens, sm_scale, attn_sink)
        if indices.dim() == 2:
            indices = indices.unsqueeze(1)
        indices = pad_topk(indices)
        topk_length = topk_length_for(seqlens, compress_ratio, indices.shape[2])
        num_rows = page_table.shape[0]
        h_pad = padded_num_heads(max(h, 1))
        kv_dtype = torch.float8_e4m3fn if self.backend == "fp8" else torch.bfloat16
        if self.workspace is None:
            self.workspace = SparsePrefillWorkspace(q.device, d_qk)
        kv = self.workspace.get(num_rows + self.extra_rows, kv_dtype, d_qk)
        self.kernels.gather(cache, page_table, page_size, layout, kv_dtype, self.extra_rows, kv)
        kv = kv[:num_rows]
        sink = None
        if attn_sink is not None:
            sink = pad_attn_sink(attn_sink, h_pad, self._sink.view((h_pad,), torch.float32, q.device))
        q_padded = self._q.view((s_q, h_pad, d_qk), kv_dtype, q.device)
        if self.backend == "fp8":
            q_scale = dynamic_q_scale(q)
            cast_q_fp8(q, q_scale, q_padded)
            out, max_logits, lse = self.kernels.attention_fp8(
                q_padded, kv, indices, sm_scale, q_scale, self._one(q.device), sink, topk_length
            )
        else:
            pad_q_heads(q, h_pad, q_padded)
            out, max_logits, lse = self.kernels.attention_bf16(
                q_padded, kv, indices, sm_scale, sink, topk_length
            )
        if h_pad != h:
            out, max_logits, lse = out[:, :h], max_logits[:, :h], lse[:, :h]
        return out, max_logits, lse

    __call__ = forward

    def _one(self, device: torch.device) -> torch.Tensor:
        if device not in self._ones:
            self._ones[device] = torch.ones(1, dtype=torch.float32, device=device)
        return self._ones[device]

    @staticmethod
    def _check(q, cache, layout, page_table, indices, seqlens, sm_scale, attn_sink) -> tuple[int, int, int]:
        for name, tensor in (
            ("q", q),
            ("page_table", page_table),
            ("indices", indices),
            ("seqlens", seqlens),
        ):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if q.dtype != torch.bfloat16:
            raise TypeError(f"q: expected dtype torch.bfloat16, got {q.dtype}")
        if q.dim() != 3:
            raise ValueError(f"q: expected a 3-D tensor [s_q, h, d_qk], got shape {list(q.shape)}")
        s_q, h, d_qk = q.shape
        if h < 1:
            raise ValueError(f"q: expected at least 1 head, got {h}")
        if d_qk != layout.d_qk:
            raise ValueError(f"q: expected d_qk = {layout.d_qk} (the {layout.name} cache's), got {d_qk}")
        if page_table.dtype not in (torch.int32, torch.int64) or page_table.dim() != 1:
            raise TypeError(
                f"page_table: expected a 1-D int32 or int64 tensor, got {page_table.dtype} "
                f"{list(page_table.shape)}"
            )
        if indices.dtype != torch.int32:
            raise TypeError(f"indices: expected dtype torch.int32, got {indices.dtype}")
        if (
            indices.dim() not in (2, 3)
            or indices.shape[0] != s_q
            or (indices.dim() == 3 and indices.shape[1] != 1)
        ):
            raise ValueError(
                f"indices: expected shape [s_q, topk] or [s_q, 1, topk] with s_q = {s_q}, "
                f"got {list(indices.shape)}"
            )
        if indices.shape[-1] < 1:
            raise ValueError("indices: expected topk >= 1")
        if seqlens.is_floating_point() or seqlens.is_complex() or seqlens.dtype == torch.bool:
            raise TypeError(f"seqlens: expected an integer tensor, got dtype {seqlens.dtype}")
        if tuple(seqlens.shape) != (s_q,):
            raise ValueError(f"seqlens: expected shape [s_q] = [{s_q}], got {list(seqlens.shape)}")
        if (
            isinstance(sm_scale, bool)
            or not isinstance(sm_scale, numbers.Real)
            or not math.isfinite(sm_scale)
        ):
            raise ValueError(f"sm_scale: expected a finite Python number, got {sm_scale!r}")
        if attn_sink is not None:
            if not isinstance(attn_sink, torch.Tensor) or attn_sink.dtype != torch.float32:
                raise TypeError("attn_sink: expected a float32 tensor [h]")
            if tuple(attn_sink.shape) != (h,):
                raise ValueError(f"attn_sink: expected shape [h] = [{h}], got {list(attn_sink.shape)}")
        for name, tensor in (
            ("cache", cache),
            ("page_table", page_table),
            ("indices", indices),
            ("seqlens", seqlens),
        ):
            if tensor.device != q.device:
                raise ValueError(
                    f"{name}: expected a tensor on {q.device} (the device of q), got {tensor.device}"
                )
        return s_q, h, d_qk
