"""``sparse_mla_q8kv8_prefill_fwd``: the PyTorch entry point, a drop-in for SGLang's function of that name.

It checks the arguments, pads the head count to the kernel's multiple of 64, allocates the outputs and
launches the CuTe DSL kernel (``q8kv8.kernels``, imported on first call). It never syncs with the GPU
unless ``Q8KV8_CHECK_RANGES=1``, so a call can be captured in a CUDA graph.
"""

import math
import sys

import torch
from torch.compiler import is_compiling

from q8kv8 import fast_launch, ops
from q8kv8.contract import check_inputs, check_ranges_enabled, check_topk_length_range
from q8kv8.metadata import HEAD_ALIGNMENT, padded_num_heads


def sparse_mla_q8kv8_prefill_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor,
    kv_scale: torch.Tensor,
    d_v: int = 512,
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
        q: [s_q, h_q, d_qk] float8_e4m3fn, d_qk in {512, 576}.
        kv: [s_kv, 1, d_qk] float8_e4m3fn; V is ``kv[..., :d_v]``.
        indices: [s_q, 1, topk] int32, topk a positive multiple of 128 (see ``pad_topk``). A slot is valid
            when its index is in ``[0, s_kv)`` and its position is below ``topk_length``; other slots are
            ignored and never read. Duplicated indices count as often as they appear.
        sm_scale: softmax scale, a finite Python number.
        q_scale, kv_scale: one-element float32 tensors, the per-tensor dequantisation scales of q and kv.
        d_v: 512.
        attn_sink: optional [h_q] float32; ``out`` is multiplied by ``1 / (1 + exp(attn_sink[h] - lse))``.
        topk_length: optional [s_q] int32, the number of leading slots of each row to consider; values
            outside [0, topk] are clamped in the kernel (``Q8KV8_CHECK_RANGES=1`` raises for them instead).
        out, max_logits, lse: optional contiguous output buffers ([s_q, h_q, d_v] bfloat16, [s_q, h_q]
            float32, [s_q, h_q] float32) that share no memory with each other or the inputs; written and
            returned when given.
        precision: "default" (P rounded to e4m3 for the PV product: ||out - ref|| / ||ref|| about 3e-2)
            or "accurate" (P kept as two e4m3 terms: about 3e-3, for 1.13-1.28x the time).

    Returns:
        ``out`` (softmax-weighted sum of ``kv[idx, :d_v] * kv_scale``), ``max_logits`` (largest logit) and
        ``lse`` (natural-log log-sum-exp of the logits ``q . kv[idx] * q_scale * kv_scale * sm_scale``).
        A row with no valid slot gets out 0, max_logits -inf and lse +inf.

    Under ``torch.compile`` this is one call of the custom op ``torch.ops.q8kv8.sparse_mla_q8kv8_prefill``
    (or of ``sparse_mla_q8kv8_prefill_out`` when buffers are given; see ``q8kv8.ops``); the op runs this
    function eagerly, checks included.
    """
    if is_compiling():
        return ops.call_traced(
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
        )
    fast = fast_launch.launch
    if (
        fast is not None
        and not check_ranges_enabled()
        # a forced schedule (tests, experiments) and stand-in kernels modules (no such attribute) take Python
        and getattr(sys.modules.get("q8kv8.kernels"), "tiles_per_cta_override", 0) is None
    ):
        # The common case, checked (outputs allocated) and launched in C++ (q8kv8.fast_launch); None:
        # declined, nothing launched. An exception is the launch's own (or torch's out-of-memory error).
        outputs = fast(
            q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length,
            out, max_logits, lse, precision,
        )  # fmt: skip
        if outputs is not None:
            return outputs
    problem = check_inputs(
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
    )
    if check_ranges_enabled():
        check_topk_length_range(topk_length, problem.topk)
    s_q, h_q = problem.s_q, problem.h_q
    if out is None or max_logits is None or lse is None:
        out, max_logits, lse = ops.output_buffers(q, h_q, problem.d_v, out, max_logits, lse)
    if s_q == 0:
        return out, max_logits, lse
    if problem.s_kv == 0:
        # Every slot is invalid: the no-valid-slot results, without launching on an empty kv.
        out.zero_()
        max_logits.fill_(-math.inf)
        lse.fill_(math.inf)
        return out, max_logits, lse

    h_kernel = h_q if h_q % HEAD_ALIGNMENT == 0 else padded_num_heads(h_q)
    if h_kernel == h_q:
        kernel_q, kernel_sink = q, attn_sink
        kernel_out, kernel_max_logits, kernel_lse = out, max_logits, lse
    else:
        kernel_q = _pad_dim(q, 1, h_kernel, 0.0)
        kernel_sink = None if attn_sink is None else _pad_dim(attn_sink, 0, h_kernel, -math.inf)
        kernel_out, kernel_max_logits, kernel_lse = ops.output_buffers(q, h_kernel, problem.d_v)

    kernels = sys.modules.get("q8kv8.kernels") or _import_kernels()
    ready = problem.launch_ready and h_kernel == h_q  # the contract saw these tensors meet the launch's needs
    if not ready:
        kernel_q = kernel_q.contiguous()
        topk_length = None if topk_length is None else topk_length.contiguous()
        kernel_sink = None if kernel_sink is None else kernel_sink.contiguous()
    kernels.launch_sparse_prefill(
        kernel_q,
        kv,
        indices,
        topk_length,
        kernel_sink,
        q_scale,
        kv_scale,
        float(sm_scale),
        kernel_out,
        kernel_max_logits,
        kernel_lse,
        precision,
        problem.tiles_per_cta,
        ready,
    )
    if h_kernel != h_q:
        out.copy_(kernel_out[:, :h_q])
        max_logits.copy_(kernel_max_logits[:, :h_q])
        lse.copy_(kernel_lse[:, :h_q])
    return out, max_logits, lse


def _pad_dim(tensor: torch.Tensor, dim: int, size: int, value: float) -> torch.Tensor:
    """``tensor`` extended along ``dim`` to ``size`` with ``value`` (a new contiguous tensor)."""
    padding_shape = list(tensor.shape)
    padding_shape[dim] = size - tensor.shape[dim]
    return torch.cat([tensor, tensor.new_full(padding_shape, value)], dim=dim)


def _import_kernels():
    """``q8kv8.kernels``, imported on the first call when ``q8kv8`` did not import it (it usually has: a
    lookup in ``sys.modules`` is the per-call path)."""
    from q8kv8 import kernels

    return kernels
