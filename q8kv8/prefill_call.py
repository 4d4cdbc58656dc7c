"""``PrefillCall`` and ``PagedCall``: the arguments of one ``sparse_mla_q8kv8_prefill_fwd`` or
``sparse_mla_q8kv8_paged_fwd`` call, as one named structure.

The public function and the custom ops build it from their parameters; everything behind them (the eager
path, the contract, the C++ extension, which reads the fields by the names ``q8kv8.native`` hands it) takes
it whole.
"""

from typing import NamedTuple

import torch

from q8kv8.metadata import D_V


class PrefillCall(NamedTuple):
    """One call's arguments, as the caller gave them (unchecked; see ``sparse_mla_q8kv8_prefill_fwd``)."""

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    q_scale: torch.Tensor | None  # None for a bfloat16 q
    kv_scale: torch.Tensor
    d_v: int = D_V
    attn_sink: torch.Tensor | None = None
    topk_length: torch.Tensor | None = None
    out: torch.Tensor | None = None
    max_logits: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    precision: str = "default"


class PagedCall(NamedTuple):
    """One ``sparse_mla_q8kv8_paged_fwd`` call's arguments, as the caller gave them (unchecked)."""

    q: torch.Tensor
    cache: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    q_scale: torch.Tensor | None = None  # None for a bfloat16 q
    d_v: int = D_V
    attn_sink: torch.Tensor | None = None
    topk_length: torch.Tensor | None = None
    out: torch.Tensor | None = None
    max_logits: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    precision: str = "default"


new_call = tuple.__new__
"""``new_call(PrefillCall, fields)`` (or ``PagedCall``): the call from a tuple of all its fields in order,
without NamedTuple's Python ``__new__`` (the hot path builds one per call)."""
