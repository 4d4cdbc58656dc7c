"""Argument checks shared by the serving modules (paged gather, query, workspace, layer)."""

import numbers

import torch


def require_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def check_buffer(name, out, shape, dtype):
    """Require ``out`` to be a contiguous tensor of ``shape`` and ``dtype``."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(out.stride())}")
