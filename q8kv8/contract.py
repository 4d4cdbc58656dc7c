"""Input contract of ``sparse_mla_q8kv8_prefill_fwd``: argument checks that never sync with the GPU.

``check_inputs`` checks types, shapes, dtypes, strides and buffer aliasing first and devices last, so every
shape or dtype violation is reported the same way on a machine without a GPU. It reads no tensor values;
only ``check_topk_length_range``, run when ``Q8KV8_CHECK_RANGES=1``, does (and syncs).
"""

import math
import numbers
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from q8kv8.metadata import TOPK_ALIGNMENT

SUPPORTED_D_QK = (512, 576)
SUPPORTED_D_V = 512
PRECISIONS = ("default", "accurate")
SM90 = (9, 0)
CHECK_RANGES_ENV = "Q8KV8_CHECK_RANGES"


class Problem(NamedTuple):
    """The sizes of one validated call."""

    s_q: int
    h_q: int
    s_kv: int
    d_qk: int
    d_v: int
    topk: int
    device: torch.device


def check_inputs(
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
) -> Problem:
    """Validate the arguments of ``sparse_mla_q8kv8_prefill_fwd`` and return the problem sizes.

    Raises TypeError for a wrong type or dtype and ValueError for anything else; the message names the
    argument, what was expected and what was got.
    """
    for name, tensor, layout in (
        ("q", q, "[s_q, h_q, d_qk]"),
        ("kv", kv, "[s_kv, h_kv, d_qk]"),
        ("indices", indices, "[s_q, 1, topk]"),
    ):
        if type(tensor) is not torch.Tensor:
            _require_tensor(name, tensor)
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected a 3-D tensor {layout}, got shape {list(tensor.shape)}")
    if q.dtype != torch.float8_e4m3fn or kv.dtype != torch.float8_e4m3fn or indices.dtype != torch.int32:
        _require_dtype("q", q, torch.float8_e4m3fn)
        _require_dtype("kv", kv, torch.float8_e4m3fn)
        _require_dtype("indices", indices, torch.int32)
    for name, tensor in (("q", q), ("kv", kv), ("indices", indices)):
        if tensor.stride(-1) != 1:
            raise ValueError(
                f"{name}: expected a contiguous last dimension (stride 1), got stride {tensor.stride(-1)}"
            )

    s_q, h_q, d_qk = q.shape
    s_kv, h_kv, kv_d_qk = kv.shape
    topk = indices.shape[2]
    if h_q < 1:
        raise ValueError(f"q: expected at least 1 head (q.shape[1]), got {h_q}")
    if h_kv != 1:
        raise ValueError(f"kv: expected h_kv = kv.shape[1] = 1 (MLA shares one latent head), got {h_kv}")
    if d_qk not in SUPPORTED_D_QK:
        raise ValueError(f"q: expected d_qk = q.shape[2] in {SUPPORTED_D_QK}, got {d_qk}")
    if kv_d_qk != d_qk:
        raise ValueError(f"kv: expected kv.shape[2] = {d_qk} (d_qk of q), got {kv_d_qk}")
    if (
        type(d_v) is not int
        and (isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral))
        or d_v != 512
    ):
        raise ValueError(f"d_v: expected the integer {SUPPORTED_D_V}, got {d_v!r}")
    if tuple(indices.shape[:2]) != (s_q, 1):
        raise ValueError(
            f"indices: expected shape [s_q, 1, topk] with s_q = {s_q}, got {list(indices.shape)}"
        )
    if topk <= 0 or topk % TOPK_ALIGNMENT != 0:
        raise ValueError(
            f"indices: expected topk = indices.shape[2] a positive multiple of {TOPK_ALIGNMENT}, got {topk}; "
            "pad it with q8kv8.pad_topk(indices)"
        )

    if type(sm_scale) is not float and (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)):
        raise TypeError(f"sm_scale: expected a Python real number, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite number, got {sm_scale}")
    for name, scale in (("q_scale", q_scale), ("kv_scale", kv_scale)):
        if type(scale) is not torch.Tensor or scale.dtype != torch.float32:
            _require_tensor(name, scale)
            _require_dtype(name, scale, torch.float32)
        if scale.numel() != 1:
            raise ValueError(
                f"{name}: expected a tensor with exactly one element, got shape {list(scale.shape)}"
            )
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")

    if attn_sink is not None:
        _require_tensor("attn_sink", attn_sink)
        _require_dtype("attn_sink", attn_sink, torch.float32)
        _require_shape("attn_sink", attn_sink, (h_q,), "[h_q]")
    if topk_length is not None:
        _require_tensor("topk_length", topk_length)
        _require_dtype("topk_length", topk_length, torch.int32)
        _require_shape("topk_length", topk_length, (s_q,), "[s_q]")

    inputs = {"q": q, "kv": kv, "indices": indices, "q_scale": q_scale, "kv_scale": kv_scale}
    if attn_sink is not None:
        inputs["attn_sink"] = attn_sink
    if topk_length is not None:
        inputs["topk_length"] = topk_length
    outputs = {}
    for name, buffer, dtype, shape, layout in (
        ("out", out, torch.bfloat16, (s_q, h_q, d_v), "[s_q, h_q, d_v]"),
        ("max_logits", max_logits, torch.float32, (s_q, h_q), "[s_q, h_q]"),
        ("lse", lse, torch.float32, (s_q, h_q), "[s_q, h_q]"),
    ):
        if buffer is None:
            continue
        if type(buffer) is not torch.Tensor or buffer.dtype != dtype or buffer.shape != shape:
            _require_tensor(name, buffer)
            _require_dtype(name, buffer, dtype)
            _require_shape(name, buffer, shape, layout)
        if not buffer.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(buffer.stride())}")
        outputs[name] = buffer
    if outputs:
        _check_no_overlap(outputs, inputs)

    devices = {name: t.device for name, t in inputs.items()}
    for name, buffer in outputs.items():
        devices[name] = buffer.device
    check_device(devices)
    return Problem(s_q=s_q, h_q=h_q, s_kv=s_kv, d_qk=d_qk, d_v=int(d_v), topk=topk, device=q.device)


def check_device(named_devices: Mapping[str, torch.device]) -> None:
    """Require every named device (``q``'s among them) to be a CUDA device, ``q``'s one, and an SM90 GPU."""
    device = named_devices["q"]
    if any(other != device for other in named_devices.values()) or device.type != "cuda":
        for name, other in named_devices.items():
            if other.type != "cuda":
                raise ValueError(f"{name}: expected a CUDA tensor, got device {other}")
        for name, other in named_devices.items():
            if other != device:
                raise ValueError(
                    f"{name}: expected a tensor on {device} (the device of q), got device {other}"
                )
    capability = _device_capability(device)
    if capability != SM90:
        raise ValueError(
            f"q: expected a GPU of compute capability 9.0 (Hopper: H100, H200), "
            f"got {_device_name(device)} on {device} with compute capability {capability[0]}.{capability[1]}"
        )


_capabilities: dict[int, tuple[int, int]] = {}


def _device_capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def check_ranges_enabled() -> bool:
    """Whether ``Q8KV8_CHECK_RANGES=1`` asks for the eager (syncing) value checks."""
    return os.environ.get(CHECK_RANGES_ENV) == "1"


def check_topk_length_range(topk_length: torch.Tensor | None, topk: int) -> None:
    """Raise ValueError unless every ``topk_length`` value lies in ``[0, topk]``. Reads the values: syncs."""
    if topk_length is None or topk_length.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(topk_length))
    if low < 0 or high > topk:
        raise ValueError(
            f"topk_length: expected values in [0, {topk}] (topk), got values from {low} to {high} "
            f"(unset {CHECK_RANGES_ENV} to have the kernel clamp them instead)"
        )


def _require_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")


def _require_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {tensor.dtype}")


def _require_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...], layout: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {layout} = {list(shape)}, got {list(tensor.shape)}")


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """The half-open byte interval spanned by ``tensor``'s elements (a superset for strided tensors)."""
    start = tensor.data_ptr()
    if tensor.is_contiguous():
        return start, start + tensor.nbytes
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * tensor.element_size()


def _span(tensor: torch.Tensor) -> tuple[int, int, torch.device] | None:
    """``(start, end, device)`` of the bytes ``tensor`` may touch; None for an empty tensor."""
    return (*_byte_range(tensor), tensor.device) if tensor.nbytes else None


def _spans_meet(a: tuple[int, int, torch.device], b: tuple[int, int, torch.device]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[2] == b[2]


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Conservatively, whether ``a`` and ``b`` may share memory: their byte intervals on one device meet
    (empty tensors never overlap). The same test ``_check_no_overlap`` applies."""
    span_a, span_b = _span(a), _span(b)
    return span_a is not None and span_b is not None and _spans_meet(span_a, span_b)


def _check_no_overlap(outputs: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> None:
    """Raise ValueError when an output buffer may share memory with an earlier output or an input.

    On the hot path of every call that passes buffers: one byte interval per tensor."""
    input_spans = [(name, span) for name, tensor in inputs.items() if (span := _span(tensor))]
    output_spans: list[tuple[str, tuple[int, int, torch.device]]] = []
    for name, buffer in outputs.items():
        span = _span(buffer)
        if span is None:
            continue
        for other, other_span in output_spans + input_spans:
            if _spans_meet(span, other_span):
                raise ValueError(f"{name}: expected memory of its own, got memory overlapping {other}")
        output_spans.append((name, span))
