"""The sparse prefill as PyTorch custom ops (``torch.library``), so that ``torch.compile`` traces it.

Two ops, registered when ``q8kv8`` is imported:

- ``torch.ops.q8kv8.sparse_mla_q8kv8_prefill(q, kv, indices, sm_scale, q_scale, kv_scale, d_v=512,
  attn_sink=None, topk_length=None, precision="default") -> (out, max_logits, lse)``: functional, it
  allocates its three outputs.
- ``torch.ops.q8kv8.sparse_mla_q8kv8_prefill_out(..., precision, out, max_logits, lse) -> ()``: writes
  the caller's buffers; declared with ``mutates_args``, so torch.compile functionalises it and Inductor
  writes the buffers in place (no extra copies, no aliasing between an op's outputs and its inputs).

``sparse_mla_q8kv8_prefill_fwd`` traced by torch.compile (``torch.compiler.is_compiling()``) calls
``call_traced``: the functional op when no buffer is given, else the out op, after allocating any missing
buffer. Eagerly it keeps its plain Python path: the op dispatcher would add several microseconds per call.

The fake (meta) implementations return correctly shaped, typed and placed outputs without reading or
checking anything; the real implementations call ``sparse_mla_q8kv8_prefill_fwd``, so every argument
check runs when the op executes, as in eager mode.
"""

import torch

OP_NAMESPACE = "q8kv8"
FUNCTIONAL_OP = "q8kv8::sparse_mla_q8kv8_prefill"
OUT_OP = "q8kv8::sparse_mla_q8kv8_prefill_out"


def output_buffers(q, h, d_v, out=None, max_logits=None, lse=None):
    """``(out, max_logits, lse)`` for q.shape[0] rows of ``h`` heads on q's device, new where not given:
    [s_q, h, d_v] bfloat16, [s_q, h] float32, [s_q, h] float32."""
    s_q = q.shape[0]
    if out is None:
        out = q.new_empty((s_q, h, d_v), dtype=torch.bfloat16)
    if max_logits is None:
        max_logits = q.new_empty((s_q, h), dtype=torch.float32)
    if lse is None:
        lse = q.new_empty((s_q, h), dtype=torch.float32)
    return out, max_logits, lse


@torch.library.custom_op(FUNCTIONAL_OP, mutates_args=())
def sparse_mla_q8kv8_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor,
    kv_scale: torch.Tensor,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    precision: str = "default",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_mla_q8kv8_prefill_fwd`` without buffers: returns new ``(out, max_logits, lse)``."""
    from q8kv8.api import sparse_mla_q8kv8_prefill_fwd

    return sparse_mla_q8kv8_prefill_fwd(
        q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, precision=precision
    )


@sparse_mla_q8kv8_prefill.register_fake
def _(
    q,
    kv,
    indices,
    sm_scale,
    q_scale,
    kv_scale,
    d_v=512,
    attn_sink=None,
    topk_length=None,
    precision="default",
):
    return output_buffers(q, q.shape[1], d_v)


@torch.library.custom_op(OUT_OP, mutates_args=("out", "max_logits", "lse"))
def sparse_mla_q8kv8_prefill_out(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor,
    kv_scale: torch.Tensor,
    d_v: int,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    precision: str,
    out: torch.Tensor,
    max_logits: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """``sparse_mla_q8kv8_prefill_fwd`` into the given ``out``, ``max_logits`` and ``lse``."""
    from q8kv8.api import sparse_mla_q8kv8_prefill_fwd

    sparse_mla_q8kv8_prefill_fwd(
        q,
        kv,
        indices,
        sm_scale,
        q_scale,
        kv_scale,
        d_v,
        attn_sink,
        topk_length,
        out=out,
        max_logits=max_logits,
        lse=lse,
        precision=precision,
    )


@sparse_mla_q8kv8_prefill_out.register_fake
def _(
    q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, precision, out, max_logits, lse
):
    return None


def call_traced(
    q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse, precision
):
    """What ``sparse_mla_q8kv8_prefill_fwd`` does when torch.compile traces it: one op call."""
    ops = torch.ops.q8kv8
    if out is None and max_logits is None and lse is None:
        return ops.sparse_mla_q8kv8_prefill.default(
            q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, precision
        )
    out, max_logits, lse = output_buffers(q, q.shape[1], d_v, out, max_logits, lse)
    ops.sparse_mla_q8kv8_prefill_out.default(
        q,
        kv,
        indices,
        sm_scale,
        q_scale,
        kv_scale,
        d_v,
        attn_sink,
        topk_length,
        precision,
        out,
        max_logits,
        lse,
    )
    return out, max_logits, lse
