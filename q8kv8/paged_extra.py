"""A paged call over a main and an extra cache as one softmax (FlashMLA's ``extra_k_cache``): DeepSeek V4.1's
main and FP4 caches, or V4's compressed and SWA caches, in one ``sparse_mla_q8kv8_paged_fwd`` call.

Algorithm: an extra cache of the main cache's layout (V4's SWA cache beside its compressed one, a second V4.1
cache) is attended in the main call itself, one launch: each query's index slots of both caches joined into
one row (``join_indices``: the main cache's, then the extra cache's; a slot at or past its part's top-k length
made -1), the kernel reading the slots from the main top-k on in the extra cache (eager calls; under
``torch.compile``, as the other layouts). So is V4.1's FP4 cache beside a V4.1 main cache, its selected slots
first gathered into tokens of V4.1's layout (``_as_records``). Any other extra cache is a second part: the
paged call on the extra cache when the paged kernel reads its layout
(``q8kv8.kv_layout.PAGED_ATTENTION_LAYOUTS``), else its selected slots (``s_q * extra_topk`` of them, each
query's own) gathered into e4m3 rows at scale 1 (``q8kv8.paged_gather``) and attended by
``sparse_mla_q8kv8_prefill_fwd``, each query its own rows; the main part is the paged call without the sink,
and the two, each with S summed in float32 (``LOGITS_IN_FLOAT32``: their lse weighs the merge), are merged
exactly by their lse into one softmax (``q8kv8.merge.merge_attention``), which applies the sink once.
Outputs as the single-cache call's: ``lse`` over both caches without the sink, ``max_logits`` the larger, a
row with no valid slot in either cache out 0, max_logits -inf, lse +inf.

Constraints: the extra cache has q's d_qk and any layout of ``q8kv8.kv_layout`` with page_size a power of
two; ``extra_indices`` are its token slots, ``[s_q, 1, extra_topk]`` int32 with extra_topk a positive
multiple of 128. Two parts' outputs are bfloat16 before the merge (about 2^-9 relative on out). No host
sync (shapes decide every branch), CUDA graph capturable; under ``torch.compile`` the parts are the custom
ops of the single-cache calls and of the gather, the merge torch operations.
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from q8kv8 import paged
from q8kv8.checks import (
    DEVICE,
    SHAPE,
    STRIDES,
    cache_geometry,
    overlaps,
    require_dtype,
    require_shape,
    require_tensor,
    signature,
)
from q8kv8.contract import check_ranges_enabled, check_topk_length_range
from q8kv8.kv_layout import (
    LAYOUT_BY_BYTES_PER_TOKEN,
    LAYOUTS,
    PAGED_ATTENTION_LAYOUTS,
    RECORDS_FROM,
    RECORDS_LAYOUT,
)
from q8kv8.merge import merge_attention
from q8kv8.metadata import LOGITS_IN_FLOAT32, TOPK_ALIGNMENT
from q8kv8.paged_gather import gather_dequant_paged
from q8kv8.prefill_call import PagedCall, PrefillCall

EVERY_LAYOUT = tuple(LAYOUT_BY_BYTES_PER_TOKEN.values())


class ExtraCache(NamedTuple):
    """The extra cache's arguments of a ``sparse_mla_q8kv8_paged_fwd`` call, as the caller gave them."""

    cache: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    topk_length: torch.Tensor | None = None


def check_extra(call: PagedCall, extra: ExtraCache) -> None:
    """Validate an extra-cache call: the main call's checks (``q8kv8.paged.check_paged_inputs``, the sink and
    buffers included), then the extra arguments', their devices last. ValueError (``InputTypeError`` for a
    type or dtype) naming the argument; reads no values, never syncs unless ``Q8KV8_CHECK_RANGES=1``."""
    if extra.cache is None:
        for name in ("indices", "topk_length"):
            if getattr(extra, name) is not None:
                raise ValueError(f"extra_{name}: expected None without an extra_cache")
        return
    problem = paged.check_paged_inputs(call)[0]
    if extra.indices is None:
        raise ValueError(
            "extra_indices: expected the extra cache's token slots [s_q, 1, extra_topk], got None"
        )
    paged.check_cache(extra.cache, problem.d_qk, "extra_cache", EVERY_LAYOUT)
    indices = signature(extra.indices)
    require_tensor("extra_indices", indices)
    require_dtype("extra_indices", indices, torch.int32)
    shape = indices[SHAPE]
    if len(shape) != 3 or shape[0] != problem.s_q or shape[1] != 1:
        raise ValueError(
            f"extra_indices: expected shape [s_q, 1, extra_topk] with s_q = {problem.s_q}, got {list(shape)}"
        )
    if shape[2] <= 0 or shape[2] % TOPK_ALIGNMENT:
        raise ValueError(
            f"extra_indices: expected extra_topk = extra_indices.shape[2] a positive multiple of "
            f"{TOPK_ALIGNMENT}, got {shape[2]}; pad it with q8kv8.pad_topk(extra_indices)"
        )
    if indices[STRIDES][2] != 1:
        stride = indices[STRIDES][2]
        raise ValueError(
            f"extra_indices: expected a contiguous last dimension (stride 1), got stride {stride}"
        )
    named = {"extra_cache": extra.cache, "extra_indices": extra.indices}
    if extra.topk_length is not None:
        length = signature(extra.topk_length)
        require_tensor("extra_topk_length", length)
        require_dtype("extra_topk_length", length, torch.int32)
        require_shape("extra_topk_length", length, (problem.s_q,), "[s_q]")
        named["extra_topk_length"] = extra.topk_length
    for buffer_name in ("out", "max_logits", "lse"):
        buffer = getattr(call, buffer_name)
        for name, tensor in named.items():
            if buffer is not None and overlaps(buffer, tensor):
                raise ValueError(f"{buffer_name}: expected memory of its own, got memory overlapping {name}")
    for name, tensor in named.items():
        device = signature(tensor)[DEVICE]
        if device != problem.device:
            raise ValueError(
                f"{name}: expected a tensor on {problem.device} (the device of q), got device {device}"
            )
    if check_ranges_enabled():
        check_topk_length_range(extra.topk_length, shape[2], "extra_topk_length")


def join_indices(call: PagedCall, extra: ExtraCache) -> torch.Tensor:
    """``[s_q, 1, topk + extra_topk]`` int32: each query's index slots of the main cache, then those of the
    extra cache, a slot at or past its part's top-k length (when given) made -1. One ``torch.cat`` without
    top-k lengths, three more small operations for each one given."""
    parts = []
    for indices, length in ((call.indices, call.topk_length), (extra.indices, extra.topk_length)):
        if length is not None:
            positions = torch.arange(indices.shape[2], dtype=torch.int32, device=indices.device)
            indices = indices.masked_fill(positions >= length.view(-1, 1, 1), -1)
        parts.append(indices)
    return torch.cat(parts, dim=2)


RECORD_BYTES = LAYOUTS[RECORDS_LAYOUT].bytes_per_token
RECORD_PAGE_SIZE = 64
"""Records a page of the gathered extra cache (``_as_records``): extra_topk is a multiple of it."""


def _as_records(extra: ExtraCache, gather: Callable) -> ExtraCache:
    """A V4.1 FP4 extra cache's selected slots gathered into records of V4.1's layout (one gather launch,
    ``q8kv8.reference.fp4_rows_as_v41``), as an extra cache of pages of ``RECORD_PAGE_SIZE`` records, and
    the records' token slots, written by the same launch: slot j of query i is record i * extra_topk + j,
    -1 for a slot outside the FP4 cache (``_gathered_rows``)."""
    cache, indices = extra.cache, extra.indices
    page_size, num_rows = cache.shape[1], indices.numel()
    records = torch.empty((num_rows, RECORD_BYTES), dtype=torch.uint8, device=indices.device)
    rows = torch.empty(indices.shape, dtype=torch.int32, device=indices.device)
    records = gather(cache, indices.reshape(-1), page_size, RECORDS_FROM, records, rows.view(-1))
    pages = records.view(num_rows // RECORD_PAGE_SIZE, RECORD_PAGE_SIZE, 1, RECORD_BYTES)
    return ExtraCache(pages, rows, extra.topk_length)


def _gathered_rows(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows that slots ``indices`` [s_q, 1, extra_topk] of ``cache`` are gathered to, each query its own:
    slot j of query i to row i * extra_topk + j, -1 for a slot outside the cache (its zero row never read)."""
    rows = torch.arange(indices.numel(), dtype=torch.int32, device=indices.device).view(indices.shape)
    return torch.where((indices >= 0) & (indices < cache.shape[0] * cache.shape[1]), rows, -1)


def attend(
    call: PagedCall,
    extra: ExtraCache,
    run_paged: Callable[[PagedCall], tuple],
    run_rows: Callable[[PrefillCall], tuple],
    gather: Callable,
    run_joined: Callable | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, max_logits, lse)`` of a checked extra-cache call (see the module), the caller's buffers
    written and returned when given. ``run_paged`` / ``run_rows`` run a single-cache paged / prefill call,
    ``gather(cache, slot_ids, page_size, layout_name, out[, rows])`` gathers e4m3 rows or V4.1 records (and
    their token slots) into ``out`` (eagerly ``q8kv8.eager.run_paged``, ``q8kv8.eager.run`` and
    ``gather_rows``; traced, the custom ops) and ``run_joined(call, extra_cache_view, extra_from)`` runs a
    paged call whose index slots from ``extra_from`` on are the extra cache's (eagerly
    ``q8kv8.eager.run_paged``; None: the parts merged)."""
    cache, indices = extra.cache, extra.indices
    layout = cache_geometry(cache)[0]
    main_layout = cache_geometry(call.cache)[0]
    if run_joined is not None and call.cache.shape[0] and call.q.shape[0]:
        joined_extra = None
        if layout == main_layout:
            joined_extra = extra
        elif layout.name == RECORDS_FROM and main_layout.name == RECORDS_LAYOUT:
            joined_extra = _as_records(extra, gather)
        if joined_extra is not None:
            view = paged.check_cache(joined_extra.cache, main_layout.d_qk, "extra_cache")[1]
            if view.shape[0]:  # the extra cache holds slots (else the main one is all of it)
                joined = call._replace(indices=join_indices(call, joined_extra), topk_length=None)
                return run_joined(joined, view, call.indices.shape[2])
    # One part's call: no sink, S summed in float32 (its lse weighs the merge)
    precision = LOGITS_IN_FLOAT32[call.precision]
    bare = call._replace(attn_sink=None, out=None, max_logits=None, lse=None, precision=precision)
    main = run_paged(bare)
    if layout in PAGED_ATTENTION_LAYOUTS:
        part = run_paged(bare._replace(cache=cache, indices=indices, topk_length=extra.topk_length))
    else:
        kv = torch.empty((indices.numel(), 1, layout.d_qk), dtype=torch.float8_e4m3fn, device=indices.device)
        kv = gather(cache, indices.reshape(-1), cache.shape[1], layout.name, kv)
        rows = _gathered_rows(cache, indices)
        q = call.q
        part = run_rows(
            PrefillCall(
                q, kv, rows, call.sm_scale, call.q_scale, paged.unit_kv_scale(q.device), call.d_v,
                topk_length=extra.topk_length, precision=precision,
            )
        )  # fmt: skip
    merged = merge_attention((main, part), call.attn_sink)
    buffers = (call.out, call.max_logits, call.lse)
    return tuple(
        values if buffer is None else buffer.copy_(values)
        for buffer, values in zip(buffers, merged, strict=True)
    )


def gather_rows(cache, slot_ids, page_size: int, layout: str, out: torch.Tensor, rows=None) -> torch.Tensor:
    """``gather_dequant_paged`` into ``out`` (its dtype the rows', no extra rows; records: their token slots
    into ``rows``); returns ``out``."""
    return gather_dequant_paged(cache, slot_ids, page_size, layout, out.dtype, 0, out, rows)
