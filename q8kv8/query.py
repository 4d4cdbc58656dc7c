"""The query side of SGLang's interface: Q cast to e4m3 into head-padded buffers, and its scale.

On a GPU ``cast_q_fp8`` is one CuTe DSL kernel (``cute_kernels/sm90/q_cast.py``); on CPU PyTorch does the
same, bit for bit. No host sync.
"""

from __future__ import annotations

import numbers

import torch

from q8kv8 import kernels
from q8kv8.arguments import check_buffer
from q8kv8.checks import overlaps
from q8kv8.metadata import E4M3_MAX, padded_num_heads

_CAST_CHUNK_ELEMENTS = 1 << 24  # float32 temporaries of cast_q_fp8: at most 64 MiB


def cast_q_fp8(q_bf16: torch.Tensor, q_scale, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q / q_scale`` in float32, rounded to nearest even into e4m3 (saturating at +-448), in a
    head-padded buffer ``[s_q, padded_num_heads(h), d]`` whose padding heads are zero.

    ``q_bf16``: [s_q, h, d] bfloat16, d a multiple of 16. ``q_scale``: a one-element float32 tensor
    on q's device (read there: no sync) or a positive Python number. ``out``: optional contiguous
    buffer of that shape, reused. On a GPU one CuTe DSL kernel (``cute_kernels/sm90/q_cast.py``) does it;
    on CPU PyTorch does, bit-exactly the same.
    """
    if not isinstance(q_bf16, torch.Tensor) or q_bf16.dtype != torch.bfloat16:
        raise TypeError(
            f"q: expected a torch.bfloat16 tensor, got {getattr(q_bf16, 'dtype', type(q_bf16).__name__)}"
        )
    if q_bf16.dim() != 3 or q_bf16.shape[2] % 16:
        raise ValueError(
            f"q: expected a 3-D tensor [s_q, h, d] with d % 16 == 0, got shape {list(q_bf16.shape)}"
        )
    s_q, h, d = q_bf16.shape
    shape = (s_q, padded_num_heads(h), d)
    if isinstance(q_scale, torch.Tensor):
        if q_scale.dtype != torch.float32 or q_scale.numel() != 1:
            raise ValueError(
                f"q_scale: expected a one-element float32 tensor, got {q_scale.dtype} {list(q_scale.shape)}"
            )
        divisor = q_scale.reshape(1)
    else:
        if isinstance(q_scale, bool) or not isinstance(q_scale, numbers.Real) or not q_scale > 0:
            raise ValueError(f"q_scale: expected a positive number or a float32 tensor, got {q_scale!r}")
        # a fill kernel: a copy from the host would sync the stream
        divisor = torch.full((1,), float(q_scale), dtype=torch.float32, device=q_bf16.device)
    if out is not None:
        check_buffer("out", out, shape, torch.float8_e4m3fn)
        if overlaps(out, q_bf16):
            raise ValueError("out: expected memory of its own, got memory overlapping q")
    for name, tensor in (("q_scale", divisor), ("out", out)):
        if tensor is not None and tensor.device != q_bf16.device:
            raise ValueError(
                f"{name}: expected a tensor on {q_bf16.device} (the device of q), got {tensor.device}"
            )
    if out is None:
        out = torch.empty(shape, dtype=torch.float8_e4m3fn, device=q_bf16.device)
    if q_bf16.is_cuda:
        if s_q:
            if (
                q_bf16.data_ptr() % 16
                or q_bf16.stride(2) != 1
                or q_bf16.stride(0) % 8
                or q_bf16.stride(1) % 8
            ):
                q_bf16 = q_bf16.clone(memory_format=torch.contiguous_format)  # read in 16-byte chunks
            if out.data_ptr() % 16:
                raise ValueError("out: expected a 16-byte aligned buffer")
            kernels.launch_cast_q_fp8(q_bf16, divisor, out)
        return out
    out[:, h:].zero_()
    rows = max(1, _CAST_CHUNK_ELEMENTS // max(1, h * d))
    for start in range(0, s_q, rows):
        chunk = torch.div(q_bf16[start : start + rows], divisor)  # float32: the 1-D divisor promotes
        out[start : start + rows, :h].copy_(chunk.clamp_(-E4M3_MAX, E4M3_MAX))
    return out


def dynamic_q_scale(q: torch.Tensor) -> torch.Tensor:
    """A power-of-two per-tensor scale for ``q`` (one-element float32 on q's device, no sync): the
    smallest 2^k >= max|q| / 448, so ``q / scale`` is exact in float32 and never saturates."""
    amax = q.detach().abs().amax().float() if q.numel() else q.new_zeros((), dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    return torch.exp2(torch.ceil(torch.log2(torch.clamp_min(amax / E4M3_MAX, tiny)))).reshape(1)
