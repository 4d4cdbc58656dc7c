"""The serving path's reusable gathered-KV workspace (stable addresses for CUDA graphs)."""

from __future__ import annotations

import math

import torch

from q8kv8.arguments import require_int
from q8kv8.kv_layout import V32
from q8kv8.paged_gather import out_dtype_of


def indexed_device(device) -> torch.device:
    """``device`` as the ``torch.device`` a tensor allocated there reports: a CUDA device given without an
    index ("cuda") is the current CUDA device, where torch allocates it."""
    device = torch.device(device)
    if device.index is None and device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


class _ReusableBuffer:
    """One flat buffer handed out as views; reallocated only when the dtype, device or size does not fit."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    def view(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self.buffer
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.device != indexed_device(device)
            or buffer.numel() < numel
        ):
            self.buffer = buffer = None  # free the old buffer before allocating the new one
            buffer = torch.empty(max(numel, 1), dtype=dtype, device=device)
            self.buffer = buffer
            self.allocations += 1
        return buffer[:numel].view(shape)


class SparsePrefillWorkspace:
    """Owns the gathered-KV workspace: one buffer, handed out as ``[num_tokens, 1, d_qk]`` views.

    ``get`` reallocates only when the requested rows do not fit the buffer or the dtype differs, so a
    smaller request after a larger one returns a view of the same memory (CUDA-graph friendly: the
    pointer is stable once the largest size has been seen; ``reserve`` that size up front).
    """

    def __init__(self, device=None, d_qk: int = V32.d_qk):
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        self.d_qk = d_qk
        self._kv = _ReusableBuffer()

    @property
    def allocations(self) -> int:
        return self._kv.allocations

    @property
    def capacity_bytes(self) -> int:
        buffer = self._kv.buffer
        return 0 if buffer is None else buffer.numel() * buffer.element_size()

    def get(self, num_tokens: int, dtype: torch.dtype, d_qk: int | None = None) -> torch.Tensor:
        """A ``[num_tokens, 1, d_qk]`` view of ``dtype`` (float8_e4m3fn or bfloat16) of the workspace."""
        num_tokens = require_int("num_tokens", num_tokens, 0)
        out_dtype_of(dtype)
        d_qk = self.d_qk if d_qk is None else d_qk
        return self._kv.view((num_tokens, 1, d_qk), dtype, self.device)

    def reserve(self, num_tokens: int, dtype: torch.dtype, d_qk: int | None = None) -> None:
        self.get(num_tokens, dtype, d_qk)
