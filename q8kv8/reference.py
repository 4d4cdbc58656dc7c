"""Float64 reference of the FP8 sparse MLA prefill, for tests: plain PyTorch, runs on CPU and GPU.

It follows the semantics of ``sparse_mla_q8kv8_prefill_fwd`` (see the README) without its layout limits:
any head count, any ``topk >= 1``, any ``d_qk``, any integer index dtype.
"""

import math

import torch


def sparse_mla_prefill_reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    q_scale: torch.Tensor | float,
    kv_scale: torch.Tensor | float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    chunk_rows: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])``, all float64 on q's device.

    Slot ``j`` of row ``i`` is valid when ``0 <= indices[i, 0, j] < s_kv`` and ``j < topk_length[i]``;
    invalid slots are never gathered. Rows with no valid slot get out 0, max_logits -inf and lse +inf.
    Query rows are processed ``chunk_rows`` at a time; a chunk holds ``chunk_rows * topk * d_qk`` float64s
    of gathered kv.
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows: expected a positive row count, got {chunk_rows}")
    s_q, h_q, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    device = q.device
    # Invalid slots gather the all-zero row appended at index s_kv (which also makes s_kv == 0 work).
    kv_rows = kv[:, 0].to(torch.float64) * float(kv_scale)
    kv_rows = torch.cat([kv_rows, kv_rows.new_zeros(1, kv_rows.shape[-1])])
    slots = torch.arange(topk, device=device)

    out = torch.empty(s_q, h_q, d_v, dtype=torch.float64, device=device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float64, device=device)
    lse = torch.empty(s_q, h_q, dtype=torch.float64, device=device)
    for start in range(0, s_q, chunk_rows):
        rows = slice(start, start + chunk_rows)
        row_indices = indices[rows, 0].long()
        valid = (row_indices >= 0) & (row_indices < s_kv)
        if topk_length is not None:
            valid &= slots < topk_length[rows, None]
        gathered = kv_rows[torch.where(valid, row_indices, s_kv)]  # [rows, topk, d_qk]
        q_rows = q[rows].to(torch.float64) * float(q_scale)
        logits = torch.einsum("rhd,rtd->rht", q_rows, gathered) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)  # -inf where no slot is valid
        has_valid = valid.any(dim=-1)[:, None]
        weights = torch.where(valid[:, None, :], torch.exp(logits - row_lse[..., None]), 0.0)
        row_out = torch.einsum("rht,rtd->rhd", weights, gathered[..., :d_v])
        if attn_sink is not None:
            # 1 / (1 + exp(sink - lse)), exactly 1 for sink -inf and 0 for sink +inf; empty rows stay 0.
            sink_factor = torch.sigmoid(row_lse - attn_sink.to(device=device, dtype=torch.float64))
            row_out = row_out * torch.where(has_valid, sink_factor, 1.0)[..., None]
        out[rows] = row_out
        max_logits[rows] = logits.amax(dim=-1)
        lse[rows] = torch.where(has_valid, row_lse, math.inf)
    return out, max_logits, lse
