"""``sparse_mla_q8kv8_prefill_fwd``: the PyTorch entry point, a drop-in for SGLang's function of that name.

Eagerly it runs the call (``q8kv8.eager``: the C++ fast path, or the checked Python path); while
torch.compile traces it, it is one custom op (``q8kv8.ops``). It never syncs with the GPU unless
``Q8KV8_CHECK_RANGES=1``, so a call can be captured in a CUDA graph.
"""

import torch
from torch.compiler import is_compiling

from q8kv8 import eager, ops
from q8kv8.metadata import D_V
from q8kv8.prefill_call import PrefillCall

_new_call = tuple.__new__  # a PrefillCall from a tuple of all its fields, without NamedTuple's Python __new__


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
        topk_length: optional [s_q] int32, the number of leading slots of each row to consider; values
            outside [0, topk] are clamped in the kernel (``Q8KV8_CHECK_RANGES=1`` raises for them instead).
        out, max_logits, lse: optional contiguous output buffers ([s_q, h_q, d_v] bfloat16, [s_q, h_q]
            float32, [s_q, h_q] float32) that share no memory with each other or the inputs; written and
            returned when given.
        precision: "default" (P rounded to e4m3 for the PV product: ||out - ref|| / ||ref|| about 3e-2)
            or "accurate" (P kept as two e4m3 terms: about 3e-3, for 1.13-1.28x the time).

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
    call = _new_call(
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
    if is_compiling():
        return ops.call_traced(call)
    return eager.run(call)
