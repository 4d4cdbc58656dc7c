"""Exact merge of attentions over disjoint row sets (split top-k, or rows that live in two caches).

Each part is ``(out, max_logits, lse)`` as the attention calls return them, computed without a sink: part i's
``out`` is its rows' softmax-weighted sum, ``lse`` their log-sum-exp (``+inf`` for a row with no valid slot,
which then weighs nothing). The merge weighs part i by ``exp(lse_i - lse)`` with ``lse`` the log of the summed
exponentials, in float32, which is the attention over the union of the rows up to the parts' own rounding;
the sink, applied once to the merged row, multiplies it by ``1 / (1 + exp(attn_sink[h] - lse))``. A
part's weight is off by exp(the absolute error of its lse) (``docs/usage.md``, "Serving path").

Two bfloat16 parts of contiguous rows of ``D_V`` values on a GPU merge in one launch
(``cute_kernels/sm90/attention_merge.py``, the same weights in float32, the output rounded once); any other
parts, on CPU, or traced by ``torch.compile``, in PyTorch operations on the parts' device. No host sync, CUDA
graph capturable either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from q8kv8 import kernels
from q8kv8.metadata import D_V


def merge_attention(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], attn_sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, max_logits, lse)`` of the attention over the union of the parts' rows (see the module).

    Args:
        parts: one or more ``(out [s_q, h, d_v], max_logits [s_q, h], lse [s_q, h])``, the same shapes, dtypes
            (out bfloat16 or float32, the statistics float32) and device; computed without a sink.
        attn_sink: optional [h] float32 per-head sink, applied to the merged rows.

    Returns ``out`` (the parts' dtype), ``max_logits`` and ``lse`` float32; a row with no valid slot in any
    part gets ``out = 0``, ``max_logits = -inf``, ``lse = +inf``.
    """
    if len(parts) == 0:
        raise ValueError("parts: expected at least one (out, max_logits, lse)")
    first_out, first_max, first_lse = parts[0]
    for i, (out, max_logits, lse) in enumerate(parts):
        if out.shape != first_out.shape or out.dtype != first_out.dtype or out.device != first_out.device:
            raise ValueError(
                f"parts[{i}]: expected out {list(first_out.shape)} {first_out.dtype} on {first_out.device}, "
                f"got {list(out.shape)} {out.dtype} on {out.device}"
            )
        for name, stat in (("max_logits", max_logits), ("lse", lse)):
            if stat.shape != first_out.shape[:2] or stat.dtype != torch.float32 or stat.device != out.device:
                raise ValueError(
                    f"parts[{i}]: expected {name} {list(first_out.shape[:2])} torch.float32, got "
                    f"{list(stat.shape)} {stat.dtype}"
                )
    h = first_out.shape[1]
    if attn_sink is not None and (attn_sink.shape != (h,) or attn_sink.dtype != torch.float32):
        raise ValueError(
            f"attn_sink: expected a float32 tensor [h] = [{h}], got {attn_sink.dtype} {list(attn_sink.shape)}"
        )
    if _one_launch(parts, attn_sink):
        (out0, max0, lse0), (out1, max1, lse1) = parts
        out = torch.empty_like(out0)
        max_logits, lse = torch.empty_like(max0), torch.empty_like(lse0)
        kernels.launch_attention_merge(
            (out0.view(-1, D_V), max0.view(-1), lse0.view(-1)),
            (out1.view(-1, D_V), max1.view(-1), lse1.view(-1)),
            attn_sink, out.view(-1, D_V), max_logits.view(-1), lse.view(-1),
        )  # fmt: skip
        return out, max_logits, lse
    lses = torch.stack([lse for _, _, lse in parts])
    lses = torch.where(lses == torch.inf, -torch.inf, lses)  # an empty part weighs nothing
    top = lses.amax(dim=0)
    top = torch.where(torch.isfinite(top), top, 0.0)
    weights = torch.exp(lses - top)  # [parts, s_q, h]
    total = weights.sum(dim=0)
    has_rows = total > 0
    lse = torch.where(has_rows, top + torch.log(total), torch.inf)
    weights = weights / torch.where(has_rows, total, 1.0)
    if attn_sink is not None:
        # 1 / (1 + exp(sink - lse)); an empty row's weights stay 0 (inf - inf would make them NaN)
        weights = weights * torch.where(has_rows, torch.sigmoid(lse - attn_sink), 1.0)
    out = sum(w[..., None] * part[0].float() for w, part in zip(weights, parts, strict=True))
    max_logits = torch.stack([m for _, m, _ in parts]).amax(dim=0)
    return out.to(first_out.dtype), max_logits, lse


def _one_launch(parts, attn_sink) -> bool:
    """Whether ``parts`` (checked) merge in one launch of the merge kernel: two bfloat16 parts on a GPU, rows
    of ``D_V`` values, every tensor contiguous and the outs 16-byte aligned, at least one row, not traced."""
    if len(parts) != 2 or torch.compiler.is_compiling():
        return False
    out = parts[0][0]
    if not out.is_cuda or out.dtype != torch.bfloat16 or out.dim() != 3 or out.shape[2] != D_V:
        return False
    if out.shape[0] * out.shape[1] == 0:
        return False
    if attn_sink is not None and (attn_sink.device != out.device or not attn_sink.is_contiguous()):
        return False  # PyTorch's operations then raise for a sink on another device
    return all(
        tensor.is_contiguous() and (tensor is not part[0] or tensor.data_ptr() % 16 == 0)
        for part in parts
        for tensor in part
    )
