"""Sparse MLA attention straight from a paged FP8 KV cache: the checks of a ``sparse_mla_q8kv8_paged_fwd``
call (``q8kv8.api``; its eager call is ``q8kv8.eager.run_paged``).

The cache is ``[num_pages, page_size, 1, bytes_per_token]`` uint8 (or an e4m3 view of it) in DeepSeek's V3.2
layout (656 bytes a token, d_qk 576), V4 / MODEL1 layout (584, d_qk 512) or V4.1 layout (528, d_qk 512;
``q8kv8.kv_layout``), its page stride ``cache.stride(0)`` bytes. ``indices`` hold token slots (page *
page_size + position); a slot outside ``[0, num_pages * page_size)`` is ignored and never read. The kernel
reads each selected row's bytes and its block scales itself (``cute_kernels/sm90/paged_rows.py``): no gathered
copy of the cache, no workspace. A call with an extra cache is ``q8kv8.paged_extra``'s composition of such
calls.

Every check but the cache's is the contract's (``q8kv8.contract.check_signatures``): the call is checked
as a ``sparse_mla_q8kv8_prefill_fwd`` call whose kv is the cache's token slots
(``q8kv8.checks.rows_signature``), with the same messages, after the cache's own checks. Nothing syncs with
the GPU (unless ``Q8KV8_CHECK_RANGES=1``).
"""

import torch

from q8kv8 import checks, contract
from q8kv8.checks import (
    DATA_PTR,
    DEVICE,
    FP8,
    STRIDES,
    InputTypeError,
    cache_geometry,
    require_aligned_pages,
    require_tensor,
    rows_signature,
    scalar_signature,
    signature,
)
from q8kv8.contract import check_signatures
from q8kv8.kv_layout import PAGED_ATTENTION_LAYOUTS, KvCacheLayout
from q8kv8.prefill_call import PagedCall, PrefillCall, new_call

CACHE_DTYPES = (torch.uint8, FP8)
MAX_SLOTS = 2**31  # token slots are int32
_ones: dict[torch.device, torch.Tensor] = {}  # unit_kv_scale's, per device


def page_size_read_directly(page_size: int) -> bool:
    """Whether the paged call reads pages of ``page_size`` tokens: a power of two (a slot's page and position
    are a shift and a mask)."""
    return page_size >= 1 and not page_size & (page_size - 1)


def check_cache(
    cache, d_qk: int, name: str = "cache", layouts=PAGED_ATTENTION_LAYOUTS
) -> tuple[KvCacheLayout, torch.Tensor]:
    """The cache's layout and its ``[num_pages, page_size, bytes_per_token]`` uint8 view (what the kernels
    read), or ValueError / ``InputTypeError`` naming what is wrong (as ``name``). ``layouts``: the layouts
    accepted (by default the ones the paged kernel reads). Reads no values, never syncs."""
    described = signature(cache)
    require_tensor(name, described)
    if cache.dtype not in CACHE_DTYPES:
        raise InputTypeError(
            f"{name}: expected dtype torch.uint8 or {FP8} (its bytes are read), got {cache.dtype}"
        )
    layout, shape = cache_geometry(cache, name)
    strides = described[STRIDES]
    if layout not in layouts:
        raise ValueError(
            f"{name}: a {layout.name} cache ({layout.bytes_per_token} bytes a token) is not read directly; "
            "gather its rows (q8kv8.gather_dequant_requant_fp8_paged with its layout) and call "
            "sparse_mla_q8kv8_prefill_fwd on them, or pass it as the paged call's extra_cache"
        )
    num_pages, page_size = shape[0], shape[1]
    if layout.d_qk != d_qk:
        raise ValueError(f"{name}: a {layout.name} cache holds d_qk {layout.d_qk}, got q with d_qk {d_qk}")
    if not page_size_read_directly(page_size):
        raise ValueError(f"{name}: expected page_size = {name}.shape[1] a power of two, got {page_size}")
    if strides[3] != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), got stride {strides[3]}")
    page_stride = strides[0]  # read for pages after the first only
    if num_pages > 1 and page_stride < layout.min_page_bytes(page_size):
        raise ValueError(
            f"{name}: expected a page stride of at least {layout.min_page_bytes(page_size)} bytes (page_size "
            f"{page_size} tokens of {layout.bytes_per_token}), got {page_stride}"
        )
    require_aligned_pages(name, described[DATA_PTR], num_pages, page_stride)
    if num_pages * page_size >= MAX_SLOTS:
        raise ValueError(f"{name}: expected fewer than 2^31 token slots, got {num_pages} x {page_size}")
    page_stride = page_stride if num_pages > 1 else layout.padded_page_bytes(page_size)
    view = _byte_view(cache).as_strided(
        (num_pages, page_size, layout.bytes_per_token), (page_stride, strides[1], 1)
    )
    return layout, view


def check_paged_inputs(call: PagedCall) -> tuple[contract.Problem, KvCacheLayout, torch.Tensor]:
    """Validate a ``sparse_mla_q8kv8_paged_fwd`` call: ``(problem, layout, the cache's view)``; ``problem``'s
    s_kv is the cache's token slots. The cache is checked first (its device last, with the others').

    As the contract's checks, a valid call's verdict is memoised under its tensors' signatures and scalars
    (a serving loop's repeated calls pay the signatures and one comparison); invalid calls never are."""
    sm_scale, d_v, precision = call.sm_scale, call.d_v, call.precision
    q_scale, attn_sink, topk_length = call.q_scale, call.attn_sink, call.topk_length
    out, max_logits, lse = call.out, call.max_logits, call.lse
    key = (
        type(sm_scale),
        type(d_v),
        type(precision),
        contract.check_device,
        signature(call.q),
        signature(call.cache),
        signature(call.indices),
        sm_scale,
        None if q_scale is None else signature(q_scale),
        d_v,
        None if attn_sink is None else signature(attn_sink),
        None if topk_length is None else signature(topk_length),
        None if out is None else signature(out),
        None if max_logits is None else signature(max_logits),
        None if lse is None else signature(lse),
        precision,
    )
    verdict = _memo.get(key)
    if verdict is None:
        verdict = checks.remember(_memo, key, _check_paged_call(call), _MEMO_ENTRIES)
    problem, layout, shape, strides = verdict
    return problem, layout, _byte_view(call.cache).as_strided(shape, strides)


_MEMO_ENTRIES = 256
_memo: dict[tuple, tuple] = checks.memo()


def _byte_view(cache: torch.Tensor) -> torch.Tensor:
    return cache if cache.dtype == torch.uint8 else cache.view(torch.uint8)


def _check_paged_call(call: PagedCall) -> tuple:
    """``check_paged_inputs``'s checks: ``(problem, layout, the view's shape and strides)``."""
    q = call.q
    q_signature = signature(q)
    require_tensor("q", q_signature)
    if q.dim() != 3:
        raise ValueError(f"q: expected a 3-D tensor [s_q, h_q, d_qk], got shape {list(q.shape)}")
    layout, view = check_cache(call.cache, q.shape[2])
    # kv: the cache's token slots as rows, and kv_scale none of the call's, both on q's device (a cache on
    # another device is reported as the cache's, below, as are overlaps with its bytes).
    kv = rows_signature(view.shape[0] * view.shape[1], layout.d_qk, q.device)
    signatures = new_call(
        PrefillCall,
        (
            q_signature,
            kv,
            signature(call.indices),
            call.sm_scale,
            None if call.q_scale is None else signature(call.q_scale),
            scalar_signature(q.device),
            call.d_v,
            None if call.attn_sink is None else signature(call.attn_sink),
            None if call.topk_length is None else signature(call.topk_length),
            None if call.out is None else signature(call.out),
            None if call.max_logits is None else signature(call.max_logits),
            None if call.lse is None else signature(call.lse),
            call.precision,
        ),
    )
    problem = check_signatures(signatures)
    for name in ("out", "max_logits", "lse"):
        buffer = getattr(call, name)
        if buffer is not None and checks.overlaps(buffer, view):
            raise ValueError(f"{name}: expected memory of its own, got memory overlapping cache")
    if view.device != q.device:
        contract.check_device({"q": q_signature[DEVICE], "cache": view.device})
    return problem, layout, tuple(view.shape), view.stride()


def unit_kv_scale(device: torch.device) -> torch.Tensor:
    """A one-element float32 1.0 on ``device``, made once: the kernel's kv_scale on a paged cache (its block
    scales apply instead)."""
    one = _ones.get(device)
    if one is None:
        one = _ones[device] = torch.ones(1, dtype=torch.float32, device=device)
    return one
