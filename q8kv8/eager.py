"""One eager call of the sparse prefill, on kv rows (``run``) or on a paged cache (``run_paged``): the C++
fast path when it takes the call, else the Python path.

``run`` is what ``sparse_mla_q8kv8_prefill_fwd`` and the custom ops' implementations execute, ``run_paged``
what ``sparse_mla_q8kv8_paged_fwd`` and its ops do. The Python path checks the call (``q8kv8.contract``,
``q8kv8.paged``), allocates the outputs and launches the kernel (``q8kv8.kernels``; any head count as it is:
8, 16 or 32 heads run the small-head kernel, others tiles of 64 heads, a token's last tile partly filled);
its first launch on a GPU registers the device with the fast path (``q8kv8.native``), which from then on
takes the calls it can plan.
"""

import contextlib
import math

import torch

from q8kv8 import contract, kernels, native, paged, schedule
from q8kv8.contract import check_inputs, check_ranges_enabled, check_topk_length_range
from q8kv8.metadata import output_layouts
from q8kv8.prefill_call import PagedCall, PrefillCall


def run(call: PrefillCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, max_logits, lse)`` of ``call``, launched on the GPU (``sparse_mla_q8kv8_prefill_fwd``)."""
    launch = native.launch
    if launch is not None and not check_ranges_enabled():
        # The common case, checked, allocated and launched in C++; None: declined, nothing launched. An
        # exception is the launch's own (or torch's out-of-memory error).
        outputs = launch(call)
        if outputs is not None:
            return outputs
    # The Python path: every call the fast path declines, with the contract's message for invalid ones.
    problem = check_inputs(call)
    q, out, max_logits, lse = call.q, call.out, call.max_logits, call.lse
    if check_ranges_enabled():
        check_topk_length_range(call.topk_length, problem.topk)
    if out is None or max_logits is None or lse is None:
        out, max_logits, lse = output_buffers(q, problem.h_q, problem.d_v, out, max_logits, lse)
    if launch_checked(call, problem, call.kv, call.kv_scale, out, max_logits, lse) and q.is_cuda:
        # The call's device (the contract checked): Tensor.is_cuda is the cheap test.
        native.note_launch(problem.device.index)
    return out, max_logits, lse


def run_paged(
    call: PagedCall, extra_cache: torch.Tensor | None = None, extra_from: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, max_logits, lse)`` of a paged call, launched on the GPU (``sparse_mla_q8kv8_paged_fwd``).
    ``extra_cache``: a checked cache view of the same layout (``paged.check_cache``) whose token slots are
    the call's index slots from ``extra_from`` on (``q8kv8.paged_extra``: the cache's are those before it),
    or None: then the fast path takes the call when it can, as ``run``'s."""
    launch = native.launch
    if launch is not None and extra_cache is None and not check_ranges_enabled():
        outputs = launch(call)
        if outputs is not None:
            return outputs
    problem, layout, view = paged.check_paged_inputs(call)
    if check_ranges_enabled():
        check_topk_length_range(call.topk_length, problem.topk)
    q = call.q
    out, max_logits, lse = output_buffers(q, problem.h_q, problem.d_v, call.out, call.max_logits, call.lse)
    # kv_scale: a 1.0 (the cache's block scales apply), made for a launch only; an empty cache (s_kv 0) has
    # every slot invalid and launches nothing.
    kv_scale = paged.unit_kv_scale(q.device) if problem.s_q and problem.s_kv else None
    extra = {} if extra_cache is None else {"extra_cache": extra_cache, "extra_from": extra_from}
    launched = launch_checked(call, problem, view, kv_scale, out, max_logits, lse, cache=layout.name, **extra)
    if launched and q.is_cuda:
        native.note_launch(problem.device.index)
    return out, max_logits, lse


def launch_checked(
    call: PrefillCall | PagedCall, problem: contract.Problem, kv, kv_scale, out, max_logits, lse, **cache
) -> bool:
    """Write a checked call's outputs (``problem``: the contract's verdict) into ``out``, ``max_logits`` and
    ``lse``: for no query, nothing; for no kv row, the no-valid-slot results; else the kernel launched on
    ``kv`` and ``kv_scale`` (q, topk_length and attn_sink made contiguous first unless the contract saw them
    meet the launch's needs). ``cache``: ``kernels.launch_sparse_prefill``'s, for a paged call. Whether the
    kernel was launched."""
    if problem.s_q == 0:
        return False
    if problem.s_kv == 0:
        # Every slot is invalid: the no-valid-slot results, without launching on an empty kv.
        out.zero_()
        max_logits.fill_(-math.inf)
        lse.fill_(math.inf)
        return False
    q, attn_sink, topk_length = call.q, call.attn_sink, call.topk_length
    ready = problem.launch_ready  # the contract saw these tensors meet the launch's needs
    if not ready:
        q = q.contiguous()
        topk_length = None if topk_length is None else topk_length.contiguous()
        attn_sink = None if attn_sink is None else attn_sink.contiguous()
    kernels.launch_sparse_prefill(
        q,
        kv,
        call.indices,
        topk_length,
        attn_sink,
        call.q_scale,
        kv_scale,
        float(call.sm_scale),
        out,
        max_logits,
        lse,
        call.precision,
        problem.tiles_per_cta,
        ready,
        problem.splits,
        problem.split_from,
        **cache,
    )
    return True


def output_buffers(q, h, d_v, out=None, max_logits=None, lse=None):
    """``(out, max_logits, lse)`` for q.shape[0] rows of ``h`` heads on q's device, new where not given:
    ``q8kv8.metadata.output_layouts``."""
    (out_shape, out_dtype), (stats_shape, stats_dtype), (lse_shape, lse_dtype) = output_layouts(
        q.shape[0], h, d_v
    )
    if out is None:
        out = q.new_empty(out_shape, dtype=out_dtype)
    if max_logits is None:
        max_logits = q.new_empty(stats_shape, dtype=stats_dtype)
    if lse is None:
        lse = q.new_empty(lse_shape, dtype=lse_dtype)
    return out, max_logits, lse


def forced_tiles_per_cta(tiles: int):
    """Tests and experiments: every launch inside runs ``tiles`` tiles per CTA (0: the one-tile kernel, not
    split; k >= 1: the persistent one with k), through the Python path (the fast path, which applies the
    schedule's rules, is suspended meanwhile)."""
    return _forced_schedule(tiles, (1, 0))


def forced_splits(parts: int, split_from: int = 0):
    """Tests and experiments: every launch inside that runs the one-tile schedule splits each tile into
    ``parts`` (1: none; else one of ``schedule.SPLIT_PARTS``), of its tokens from ``split_from`` on (0:
    all; else a split tail, the tokens before it one tile per CTA; less than every call's s_q), through the
    Python path (the fast path is suspended meanwhile)."""
    if parts != 1 and parts not in schedule.SPLIT_PARTS:
        raise ValueError(f"parts: expected 1 or one of {schedule.SPLIT_PARTS}, got {parts}")
    if split_from < 0:
        raise ValueError(f"split_from: expected a token index >= 0, got {split_from}")
    return _forced_schedule(schedule.forced, (parts, split_from if parts > 1 else 0))


@contextlib.contextmanager
def _forced_schedule(tiles: int | None, splits: tuple[int, int]):
    """``schedule.forced`` and ``schedule.forced_splits`` set while active, the fast path suspended."""
    previous = schedule.forced, schedule.forced_splits
    schedule.forced, schedule.forced_splits = tiles, splits
    contract.clear_memo()  # memoised verdicts carry the schedule
    try:
        with native.suspended():
            yield
    finally:
        schedule.forced, schedule.forced_splits = previous
        contract.clear_memo()
