"""The sparse prefill as PyTorch custom ops (``torch.library``), so that ``torch.compile`` traces it.

The prefill ops, registered when ``q8kv8`` is imported (the paged call's pair, ``..._paged`` and
``..._paged_out``, and the gather's out op, ``gather_dequant_paged_out``, follow the same rules):

- ``torch.ops.q8kv8.sparse_mla_q8kv8_prefill(q, kv, indices, sm_scale, q_scale, kv_scale, d_v=512,
  attn_sink=None, topk_length=None, precision="default") -> (out, max_logits, lse)``: functional, it
  allocates its three outputs.
- ``torch.ops.q8kv8.sparse_mla_q8kv8_prefill_out(..., precision, out, max_logits, lse) -> ()``: writes
  the caller's buffers; declared with ``mutates_args``, so torch.compile functionalises it and Inductor
  writes the buffers in place (no extra copies, no aliasing between an op's outputs and its inputs).

``q_scale`` is an optional tensor (``Tensor?``) in both schemas: None for a bfloat16 ``q``.

``sparse_mla_q8kv8_prefill_fwd`` traced by torch.compile calls ``call_traced``: the functional op when no
buffer is given, else the out op, after allocating any missing buffer. Eagerly it does not go through the
op dispatcher, which would add several microseconds per call. The fake implementations return correctly
shaped, typed and placed outputs without reading or checking anything; the real ones run the eager call
(``q8kv8.eager.run``), checks included.
"""

import torch

from q8kv8 import eager
from q8kv8.eager import output_buffers
from q8kv8.metadata import D_V
from q8kv8.paged_gather import gather_dequant_paged
from q8kv8.prefill_call import PagedCall, PrefillCall

FUNCTIONAL_OP = "q8kv8::sparse_mla_q8kv8_prefill"
OUT_OP = "q8kv8::sparse_mla_q8kv8_prefill_out"
INPUT_FIELDS = 9
"""Both ops' first parameters are PrefillCall's first INPUT_FIELDS fields (q ... topk_length); then come
precision and, for the out op, the three buffers."""


@torch.library.custom_op(FUNCTIONAL_OP, mutates_args=())
def sparse_mla_q8kv8_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | None,
    kv_scale: torch.Tensor,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    precision: str = "default",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_mla_q8kv8_prefill_fwd`` without buffers: returns new ``(out, max_logits, lse)``."""
    return eager.run(
        PrefillCall(
            q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, precision=precision
        )
    )


@sparse_mla_q8kv8_prefill.register_fake
def _(q, *_args, **_kwargs):
    return output_buffers(q, q.shape[1], D_V)  # d_v is D_V in every call the op accepts


@torch.library.custom_op(OUT_OP, mutates_args=("out", "max_logits", "lse"))
def sparse_mla_q8kv8_prefill_out(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | None,
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
    eager.run(
        PrefillCall(
            q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length, out, max_logits, lse,
            precision,
        )
    )  # fmt: skip


@sparse_mla_q8kv8_prefill_out.register_fake
def _(*_args, **_kwargs):
    return None


def _call_op_pair(call: PrefillCall | PagedCall, input_fields: int, functional, out_op):
    """One traced call of an op pair: ``functional`` (the call's first ``input_fields`` fields and its
    precision) when no buffer is given, else ``out_op`` on the buffers, any missing one allocated."""
    inputs = call[:input_fields]
    if call.out is None and call.max_logits is None and call.lse is None:
        return functional(*inputs, call.precision)
    out, max_logits, lse = output_buffers(
        call.q, call.q.shape[1], call.d_v, call.out, call.max_logits, call.lse
    )
    out_op(*inputs, call.precision, out, max_logits, lse)
    return out, max_logits, lse


def call_traced(call: PrefillCall):
    """What ``sparse_mla_q8kv8_prefill_fwd`` does when torch.compile traces it: one op call."""
    ops = torch.ops.q8kv8
    return _call_op_pair(
        call, INPUT_FIELDS, ops.sparse_mla_q8kv8_prefill.default, ops.sparse_mla_q8kv8_prefill_out.default
    )


PAGED_FUNCTIONAL_OP = "q8kv8::sparse_mla_q8kv8_paged"
PAGED_OUT_OP = "q8kv8::sparse_mla_q8kv8_paged_out"
PAGED_INPUT_FIELDS = 8
"""Both paged ops' first parameters are PagedCall's first PAGED_INPUT_FIELDS fields (q ... topk_length)."""


@torch.library.custom_op(PAGED_FUNCTIONAL_OP, mutates_args=())
def sparse_mla_q8kv8_paged(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | None = None,
    d_v: int = D_V,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    precision: str = "default",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sparse_mla_q8kv8_paged_fwd`` without buffers: returns new ``(out, max_logits, lse)``."""
    return eager.run_paged(
        PagedCall(q, cache, indices, sm_scale, q_scale, d_v, attn_sink, topk_length, precision=precision)
    )


@sparse_mla_q8kv8_paged.register_fake
def _(q, *_args, **_kwargs):
    return output_buffers(q, q.shape[1], D_V)


@torch.library.custom_op(PAGED_OUT_OP, mutates_args=("out", "max_logits", "lse"))
def sparse_mla_q8kv8_paged_out(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | None,
    d_v: int,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    precision: str,
    out: torch.Tensor,
    max_logits: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """``sparse_mla_q8kv8_paged_fwd`` into the given ``out``, ``max_logits`` and ``lse``."""
    eager.run_paged(
        PagedCall(
            q, cache, indices, sm_scale, q_scale, d_v, attn_sink, topk_length, out, max_logits, lse, precision
        )
    )


@sparse_mla_q8kv8_paged_out.register_fake
def _(*_args, **_kwargs):
    return None


def call_paged_traced(call: PagedCall):
    """What ``sparse_mla_q8kv8_paged_fwd`` does when torch.compile traces it: one op call."""
    ops = torch.ops.q8kv8
    return _call_op_pair(
        call, PAGED_INPUT_FIELDS, ops.sparse_mla_q8kv8_paged.default, ops.sparse_mla_q8kv8_paged_out.default
    )


GATHER_OUT_OP = "q8kv8::gather_dequant_paged_out"


@torch.library.custom_op(GATHER_OUT_OP, mutates_args=("out",))
def gather_dequant_paged_out(
    cache: torch.Tensor, slot_ids: torch.Tensor, page_size: int, layout: str, out: torch.Tensor
) -> None:
    """``q8kv8.paged_gather.gather_dequant_paged`` into the given ``out`` (its dtype the rows', no extra
    rows): the gather of a paged call's extra cache (``q8kv8.paged_extra``) when torch.compile traces it."""
    gather_dequant_paged(cache, slot_ids, page_size, layout, out.dtype, 0, out)


@gather_dequant_paged_out.register_fake
def _(*_args, **_kwargs):
    return None


def gather_traced(cache, slot_ids, page_size: int, layout: str, out):
    """The gather as one op call, for traced code; returns ``out``."""
    torch.ops.q8kv8.gather_dequant_paged_out.default(cache, slot_ids, page_size, layout, out)
    return out
