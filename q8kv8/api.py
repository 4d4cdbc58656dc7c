"""The PyTorch entry points: ``sparse_mla_q8kv8_prefill_fwd`` (a drop-in for SGLang's function of that name)
and ``sparse_mla_q8kv8_paged_fwd`` (the same attention straight from a paged FP8 KV cache).

Eagerly it runs the call (``q8kv8.eager``: the C++ fast path, or the checked Python path); while
torch.compile traces it, it is one custom op (``q8kv8.ops``). It never syncs with the GPU unless
``Q8KV8_CHECK_RANGES=1``, so a call can be captured in a CUDA graph.
"""

import torch
from torch.compiler import is_compiling

from q8kv8 import eager, ops, paged_extra
from q8kv8.metadata import D_V
from q8kv8.prefill_call import PagedCall, PrefillCall, new_call


def sparse_mla_q8kv8_prefill_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | None,
    kv_scale: torch.Tensor,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_logits: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    precision: str = "default",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 sparse MLA prefill attention on an SM90 GPU; returns ``(out, max_logits, lse)``.

    Args:
        q: [s_q, h_q, d_qk] float8_e4m3fn or bfloat16, d_qk in {512, 576}. The kernel quantises a bfloat16
            q to e4m3 itself (no separate pass over q): each (token, head) row ``q[i, h]`` divided by its own
            power-of-two scale ``s[i, h]``, the smallest ``2^e`` with ``max|q[i, h]| <= 448 * 2^e`` (e in
            [-126, 127]; 1 for an all-zero row), rounded to nearest even
            (``q8kv8.reference.quantize_q_rows``); ``s[i, h]`` takes ``q_scale``'s place in that row's logits.
        kv: [s_kv, 1, d_qk] float8_e4m3fn; V is ``kv[..., :d_v]``.
        indices: [s_q, 1, topk] int32, topk a positive multiple of 128 (see ``pad_topk``). A slot is valid
            when its index is in ``[0, s_kv)`` and its position is below ``topk_length``; other slots are
            ignored and never read. Duplicated indices count as often as they appear.
        sm_scale: softmax scale, a finite Python number.
        q_scale: one-element float32 tensor, the per-tensor dequantisation scale of an e4m3 q; None for a
            bfloat16 q.
        kv_scale: one-element float32 tensor, the per-tensor dequantisation scale of kv.
        d_v: 512.
        attn_sink: optional [h_q] float32; ``out`` is multiplied by ``1 / (1 + exp(attn_sink[h] - lse))``.
            With a sink the call sums S in float32 whatever its precision ("default" runs as
            "accurate_logits", "accurate_out" as "accurate": ``q8kv8.metadata.LOGITS_IN_FLOAT32``), since
            the sink turns an error in ``lse`` into one of ``out``.
        topk_length: optional [s_q] int32, the number of leading slots of each row to consider; values
            outside [0, topk] are clamped in the kernel (``Q8KV8_CHECK_RANGES=1`` raises for them instead).
        out, max_logits, lse: optional contiguous output buffers ([s_q, h_q, d_v] bfloat16, [s_q, h_q]
            float32, [s_q, h_q] float32) that share no memory with each other or the inputs; written and
            returned when given.
        precision: "default" (P rounded to e4m3 for the PV product: ||out - ref|| / ||ref|| about 3e-2;
            QK summed by the FP8 tensor cores: logits within about 2e-3, up to 1% low on a row led by one
            slot), "accurate_out" (P kept as two e4m3 terms: about 3e-3), "accurate_logits" (QK summed in
            float32 every 2 k-steps: logits within 3.3e-4, on a row led by one slot too; to merge by or
            apply a sink to) or "accurate" (both); each costs only what it buys (``make bench`` times them
            side by side).

    Returns:
        ``out`` (softmax-weighted sum of ``kv[idx, :d_v] * kv_scale``), ``max_logits`` (largest logit) and
        ``lse`` (natural-log log-sum-exp of the logits ``q . kv[idx] * q_scale * kv_scale * sm_scale``, with
        the e4m3 row and its scale ``s[i, h]`` in place of ``q`` and ``q_scale`` for a bfloat16 q).
        A row with no valid slot gets out 0, max_logits -inf and lse +inf.

    Under ``torch.compile`` this is one call of the custom op ``torch.ops.q8kv8.sparse_mla_q8kv8_prefill``
    (or of ``sparse_mla_q8kv8_prefill_out`` when buffers are given; see ``q8kv8.ops``); the op runs the
    eager call, checks included.
    """
    # The parameters in order are PrefillCall's fields (tests/test_api_cpu.py checks it).
    call = new_call(
        PrefillCall,
        (
            q,
            kv,
            indices,
            sm_scale,
            q_scale,
            kv_scale,
            d_v,
            attn_sink,
            topk_length,
            out,
            max_logits,
            lse,
            precision,
        ),
    )
    return attend(call)


def sparse_mla_q8kv8_paged_fwd(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | None = None,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    max_logits: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    precision: str = "default",
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse MLA attention read straight from a paged FP8 KV cache; returns ``(out, max_logits, lse)``.

    Args:
        q: [s_q, h_q, d_qk] bfloat16 (quantised per row by the kernel, ``q_scale=None``) or float8_e4m3fn with
            its ``q_scale``; d_qk the cache's (576: V3.2, 512: V4 / MODEL1 and V4.1).
        cache: [num_pages, page_size, 1, bytes_per_token] uint8 or float8_e4m3fn: DeepSeek V3.2's layout (656
            bytes a token), V4's (584) or V4.1's (528; ``q8kv8.kv_layout``), page_size a power of two, page
            stride ``cache.stride(0)`` bytes (16-byte aligned, like the base).
        indices: [s_q, 1, topk] int32 token slots (page * page_size + position), topk a positive multiple of
            128; a slot outside ``[0, num_pages * page_size)`` is ignored and never read.
        sm_scale, q_scale, d_v, attn_sink, topk_length, out, max_logits, lse, precision: as in
            ``sparse_mla_q8kv8_prefill_fwd`` (there is no kv_scale: each row's block scales apply).
        extra_cache: optional second paged cache attended in the same softmax (FlashMLA's ``extra_k_cache``:
            DeepSeek V4.1's FP4 cache, 288 bytes a token, next to its main cache, or V4's SWA cache next to
            its compressed one): any layout of ``q8kv8.kv_layout`` with q's d_qk, page_size a power of two.
        extra_indices: [s_q, 1, extra_topk] int32 token slots of ``extra_cache`` (FlashMLA's
            ``extra_indices_in_kvcache``), extra_topk a positive multiple of 128; required with it.
        extra_topk_length: optional [s_q] int32, the number of leading slots of ``extra_indices`` to consider
            (clamped as ``topk_length``).

    Each selected row is read from the cache as it is: its e4m3 values with their block scales (V3.2: the QK
    product summed in float32 per scale group; V4, V4.1: the row rescaled to one power-of-two scale, exact
    for power-of-two scales; V at one power-of-two scale per row,
    which P carries), a bf16 RoPE as two e4m3 terms with a power-of-two scale of its own row (V4's V: one
    term). Same outputs, sentinels, head counts (any h_q, in tiles of 64 heads), errors and CUDA-graph
    behaviour as ``sparse_mla_q8kv8_prefill_fwd``; under ``torch.compile`` the custom op
    ``torch.ops.q8kv8.sparse_mla_q8kv8_paged`` (``..._paged_out`` with buffers).

    With an extra cache (``q8kv8.paged_extra``) each query attends its valid slots of both caches as one
    softmax. An extra cache of the cache's layout is read in the same launch (both index rows joined into
    one), and so is a V4.1 FP4 cache beside a V4.1 cache, its selected slots gathered into V4.1 tokens first.
    Another one is a second part: read directly when the paged kernel reads its layout (V3.2, V4, V4.1) or
    else gathered to e4m3 rows (scale 1) and attended by ``sparse_mla_q8kv8_prefill_fwd``, the main part
    without the sink, the two merged exactly by their lse, then the sink applied once (``max_logits``: the
    larger of the parts'; ``lse`` over both, without the sink). ``extra_indices`` or ``extra_topk_length``
    without ``extra_cache`` is an error before anything else is checked; with one, the main call is checked
    first, then the extra arguments. Under ``torch.compile`` (the custom ops are not extended) every extra
    cache is a second part, composed of the single-cache calls' ops (the gather's,
    ``torch.ops.q8kv8.gather_dequant_paged_out``, for an extra cache the paged kernel does not read) and torch
    operations, and the arguments are checked by the parts' ops under the single-cache names.
    """
    call = new_call(
        PagedCall,
        (q, cache, indices, sm_scale, q_scale, d_v, attn_sink, topk_length, out, max_logits, lse, precision),
    )
    if extra_cache is not None or extra_indices is not None or extra_topk_length is not None:
        extra = paged_extra.ExtraCache(extra_cache, extra_indices, extra_topk_length)
        if is_compiling():
            return paged_extra.attend(call, extra, ops.call_paged_traced, ops.call_traced, ops.gather_traced)
        paged_extra.check_extra(call, extra)
        return paged_extra.attend(
            call, extra, eager.run_paged, eager.run, paged_extra.gather_rows, eager.run_paged
        )
    return attend_paged(call)


def attend(call: PrefillCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_mla_q8kv8_prefill_fwd`` of a call already gathered into a ``PrefillCall`` (what the public
    function and the serving layer, ``q8kv8.serving``, run): the custom op while torch.compile traces,
    else the eager call (``q8kv8.eager.run``), checks included."""
    if is_compiling():
        return ops.call_traced(call)
    return eager.run(call)


def attend_paged(call: PagedCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_mla_q8kv8_paged_fwd`` of a single-cache call already gathered into a ``PagedCall``: the
    custom op while torch.compile traces, else the eager call (``q8kv8.eager.run_paged``), checks included."""
    if is_compiling():
        return ops.call_paged_traced(call)
    return eager.run_paged(call)
