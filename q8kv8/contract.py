"""Input contract of ``sparse_mla_q8kv8_prefill_fwd``: argument checks that never sync with the GPU.

``check_inputs`` checks types, shapes, dtypes, strides and buffer aliasing first and devices last, so every
shape or dtype violation is reported the same way on a machine without a GPU. It reads no tensor values;
only ``check_topk_length_range``, run when ``Q8KV8_CHECK_RANGES=1``, does (and syncs).

On the hot path of every call: each tensor is read once into a signature (``q8kv8.checks``: type, shape,
strides, dtype, device, data pointer), the checks read only the signatures, and a valid call's result is
memoised under them, so a repeated call costs the signatures and one comparison. ``check_signatures`` runs
the checks on signatures: ``q8kv8.paged`` checks its calls through it, with the cache's token slots as kv.
"""

import math
import numbers
import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from q8kv8 import checks, schedule
from q8kv8.checks import (
    DATA_PTR,
    DEVICE,
    DTYPE,
    FP8,
    SHAPE,
    STRIDES,
    TYPE,
    InputTypeError,
    is_contiguous,
    require_dtype,
    require_shape,
    require_tensor,
    signature,
    span,
)
from q8kv8.metadata import (
    D_V,
    KV_ROW_ALIGNMENT_BYTES,
    LAUNCH_ALIGNMENT_BYTES,
    PRECISIONS,
    Q_DTYPES,
    ROW_SCALED_Q_DTYPES,
    SUPPORTED_D_QK,
    TOPK_ALIGNMENT,
)
from q8kv8.prefill_call import PrefillCall, new_call

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
    tiles_per_cta: int = 0  # the kernel schedule (``q8kv8.schedule``): 0 one tile per CTA, k >= 1 persistent
    # The tensors as they are meet the launch's layout needs (q row-major and 16-byte aligned, kv's base and
    # row stride multiples of 16 bytes, out 4-byte aligned, topk_length and attn_sink contiguous), so the
    # launch may skip its own checks and copies (``kernels.launch_sparse_prefill(..., ready=True)``).
    launch_ready: bool = False
    splits: int = 1  # one-tile schedule: the parts each split tile is in (``q8kv8.schedule.split_tokens``)
    split_from: int = 0  # with splits > 1: the first token split (0: all; else a split tail)


_MEMO_ENTRIES = 256  # first-level keys (q's data pointers) before the memo is emptied
_MEMO_ENTRIES_PER_Q = 8  # signatures remembered per q data pointer, newest first
_memo: dict[int | None, list[tuple[tuple, Problem]]] = checks.memo()
"""``check_inputs``'s verdicts on valid calls: ``(signature key, problem)`` pairs, found through q's data
pointer (an int: no hashing of the whole key) and then compared whole."""


def check_inputs(call: PrefillCall) -> Problem:
    """Validate the arguments of ``sparse_mla_q8kv8_prefill_fwd`` and return the problem sizes.

    Raises ``InputTypeError`` (a TypeError and a ValueError) for a wrong type or dtype and ValueError for
    anything else; the message names the argument, what was expected and what was got.

    The checks read each tensor once, into its signature (type, shape, strides, dtype, device, data
    pointer), and then only the signatures, the scalar arguments and the device check in use. The verdict
    is therefore a function of those: a valid call's is memoised under them, and a later call with the
    same ones (a serving loop over the same buffers, a benchmark, the layers of one step) returns the
    memoised problem without re-running the checks. Invalid calls are never memoised.
    """
    sm_scale, d_v, precision = call.sm_scale, call.d_v, call.precision
    attn_sink, topk_length = call.attn_sink, call.topk_length
    out, max_logits, lse = call.out, call.max_logits, call.lse
    # The call with each tensor replaced by its signature (an absent one stays None), in field order.
    signatures = (
        signature(call.q),
        signature(call.kv),
        signature(call.indices),
        sm_scale,
        None if call.q_scale is None else signature(call.q_scale),
        signature(call.kv_scale),
        d_v,
        None if attn_sink is None else signature(attn_sink),
        None if topk_length is None else signature(topk_length),
        None if out is None else signature(out),
        None if max_logits is None else signature(max_logits),
        None if lse is None else signature(lse),
        precision,
    )
    # The scalars' types join the key (1 and 1.0 and True are equal), first: a memoised (valid) call's
    # scalars are then only ever compared with values of their own types. The device check and the
    # capability lookup join it too, so that replacing them (as tests do) is never answered from the memo.
    key = (type(sm_scale), type(d_v), type(precision), check_device, _device_capability, signatures)
    q_data_ptr = signatures[0][DATA_PTR]
    entries = _memo.get(q_data_ptr)
    if entries is not None:
        for entry_key, problem in entries:
            if entry_key == key:
                return problem
    problem = check_signatures(new_call(PrefillCall, signatures))
    if entries is None:
        checks.remember(_memo, q_data_ptr, [(key, problem)], _MEMO_ENTRIES)
    else:
        entries.insert(0, (key, problem))
        del entries[_MEMO_ENTRIES_PER_Q:]
    return problem


def clear_memo() -> None:
    """Forget every memoised verdict, this module's and the other checks' (``q8kv8.checks.clear_memos``):
    after a change that the memos' keys do not see (a forced schedule)."""
    _memo.clear()
    checks.clear_memos()


def check_signatures(signatures: PrefillCall) -> Problem:
    """The checks of ``check_inputs`` on a call whose tensors are their signatures (``q8kv8.checks``; None
    for an absent optional tensor). kv and kv_scale may be ``checks.rows_signature`` and
    ``checks.scalar_signature``: a paged cache's token slots, as ``q8kv8.paged`` checks its calls."""
    q, kv, indices = signatures.q, signatures.kv, signatures.indices
    q_scale, kv_scale = signatures.q_scale, signatures.kv_scale
    attn_sink, topk_length = signatures.attn_sink, signatures.topk_length
    out, max_logits, lse = signatures.out, signatures.max_logits, signatures.lse
    sm_scale, d_v, precision = signatures.sm_scale, signatures.d_v, signatures.precision
    # Each group of checks: one test that valid arguments pass, then the checks one by one, in order, for
    # the message.
    if not (
        q[TYPE] is kv[TYPE] is indices[TYPE] is torch.Tensor
        and len(q[SHAPE]) == len(kv[SHAPE]) == len(indices[SHAPE]) == 3
    ):
        for name, tensor, layout in (
            ("q", q, "[s_q, h_q, d_qk]"),
            ("kv", kv, "[s_kv, h_kv, d_qk]"),
            ("indices", indices, "[s_q, 1, topk]"),
        ):
            require_tensor(name, tensor)
            if len(tensor[SHAPE]) != 3:
                raise ValueError(f"{name}: expected a 3-D tensor {layout}, got shape {list(tensor[SHAPE])}")
    if q[DTYPE] not in Q_DTYPES or kv[DTYPE] != FP8 or indices[DTYPE] != torch.int32:
        _require_q_dtype(q)
        require_dtype("kv", kv, FP8)
        require_dtype("indices", indices, torch.int32)
    if q[STRIDES][-1] != 1 or kv[STRIDES][-1] != 1 or indices[STRIDES][-1] != 1:
        for name, tensor in (("q", q), ("kv", kv), ("indices", indices)):
            last_stride = tensor[STRIDES][-1]
            if last_stride != 1:
                raise ValueError(
                    f"{name}: expected a contiguous last dimension (stride 1), got stride {last_stride}"
                )

    s_q, h_q, d_qk = q[SHAPE]
    s_kv, h_kv, kv_d_qk = kv[SHAPE]
    indices_shape = indices[SHAPE]
    topk = indices_shape[2]
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
        or d_v != D_V
    ):
        raise ValueError(f"d_v: expected the integer {D_V}, got {d_v!r}")
    if indices_shape[0] != s_q or indices_shape[1] != 1:
        raise ValueError(
            f"indices: expected shape [s_q, 1, topk] with s_q = {s_q}, got {list(indices_shape)}"
        )
    if topk <= 0 or topk % TOPK_ALIGNMENT != 0:
        raise ValueError(
            f"indices: expected topk = indices.shape[2] a positive multiple of {TOPK_ALIGNMENT}, got {topk}; "
            "pad it with q8kv8.pad_topk(indices)"
        )

    if type(sm_scale) is not float and (not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool)):
        raise InputTypeError(f"sm_scale: expected a Python real number, got {type(sm_scale).__name__}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale: expected a finite number, got {sm_scale}")
    # A bfloat16 q is scaled per row by the kernel: no q_scale; an e4m3 q comes with its q_scale.
    row_scaled = q[DTYPE] in ROW_SCALED_Q_DTYPES
    if row_scaled and q_scale is not None:
        raise InputTypeError(
            f"q_scale: expected None for a {q[DTYPE]} q, got {q_scale[TYPE].__name__} (q_scale must be None "
            "for bfloat16 q: the kernel scales each row itself)"
        )
    if not row_scaled and q_scale is None:
        raise InputTypeError(
            f"q_scale: expected a torch.Tensor, got NoneType (q_scale may be None only for a "
            f"{ROW_SCALED_Q_DTYPES[0]} q; a {q[DTYPE]} q needs its scale)"
        )
    scales = (("kv_scale", kv_scale),) if row_scaled else (("q_scale", q_scale), ("kv_scale", kv_scale))
    if not all(
        scale[TYPE] is torch.Tensor and scale[DTYPE] == torch.float32 and math.prod(scale[SHAPE]) == 1
        for _, scale in scales
    ):
        for name, tensor in scales:
            require_tensor(name, tensor)
            require_dtype(name, tensor, torch.float32)
            if math.prod(tensor[SHAPE]) != 1:
                raise ValueError(
                    f"{name}: expected a tensor with exactly one element ({name} must be a scalar tensor), "
                    f"got shape {list(tensor[SHAPE])}"
                )
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")

    if attn_sink is not None:
        require_tensor("attn_sink", attn_sink)
        require_dtype("attn_sink", attn_sink, torch.float32)
        require_shape("attn_sink", attn_sink, (h_q,), "[h_q]")
    if topk_length is not None:
        require_tensor("topk_length", topk_length)
        require_dtype("topk_length", topk_length, torch.int32)
        require_shape("topk_length", topk_length, (s_q,), "[s_q]")

    inputs = {"q": q, "kv": kv, "indices": indices}
    if q_scale is not None:
        inputs["q_scale"] = q_scale
    inputs["kv_scale"] = kv_scale
    if attn_sink is not None:
        inputs["attn_sink"] = attn_sink
    if topk_length is not None:
        inputs["topk_length"] = topk_length
    outputs = {}
    for name, tensor, dtype, shape, row_major, layout in (
        ("out", out, torch.bfloat16, (s_q, h_q, d_v), (h_q * d_v, d_v, 1), "[s_q, h_q, d_v]"),
        ("max_logits", max_logits, torch.float32, (s_q, h_q), (h_q, 1), "[s_q, h_q]"),
        ("lse", lse, torch.float32, (s_q, h_q), (h_q, 1), "[s_q, h_q]"),
    ):
        if tensor is None:
            continue
        if tensor[TYPE] is not torch.Tensor or tensor[DTYPE] != dtype or tensor[SHAPE] != shape:
            require_tensor(name, tensor)
            require_dtype(name, tensor, dtype)
            require_shape(name, tensor, shape, layout)
        strides = tensor[STRIDES]
        if strides != row_major and not is_contiguous(shape, strides):
            raise ValueError(f"{name}: expected a contiguous tensor, got strides {list(strides)}")
        outputs[name] = tensor
    if outputs:
        _check_no_overlap(outputs, inputs)

    devices = {name: tensor[DEVICE] for name, tensor in inputs.items()}
    for name, tensor in outputs.items():
        devices[name] = tensor[DEVICE]
    check_device(devices)
    device = q[DEVICE]
    chosen = schedule.Schedule(0)
    if device.type == "cuda" and s_q > 0 and s_kv > 0:
        chosen = schedule.choose(s_q, h_q, topk, topk_length is not None, device.index)
    launch_ready = (
        all(
            (tensor := getattr(signatures, name)) is None or tensor[DATA_PTR] % alignment == 0
            for name, alignment in LAUNCH_ALIGNMENT_BYTES.items()
        )
        and is_contiguous(q[SHAPE], q[STRIDES])
        and kv[STRIDES][0] % KV_ROW_ALIGNMENT_BYTES == 0  # e4m3: elements are bytes
        and (topk_length is None or is_contiguous(topk_length[SHAPE], topk_length[STRIDES]))
        and (attn_sink is None or is_contiguous(attn_sink[SHAPE], attn_sink[STRIDES]))
    )
    tiles, splits, split_from = chosen
    return Problem(s_q, h_q, s_kv, d_qk, int(d_v), topk, device, tiles, launch_ready, splits, split_from)


def check_device(named_devices: Mapping[str, torch.device]) -> None:
    """Require every named device (``q``'s among them) to be a CUDA device, ``q``'s one, and an SM90 GPU."""
    device = named_devices["q"]
    for other in named_devices.values():
        if other != device:
            break
    else:
        if device.type == "cuda":
            capability = _device_capability(device)
            if capability != SM90:
                major, minor = capability
                raise ValueError(
                    f"q: expected a GPU of compute capability 9.0 (Hopper: H100, H200), "
                    f"got {_device_name(device)} on {device} with compute capability {major}.{minor}"
                )
            return
    for name, other in named_devices.items():
        if other.type != "cuda":
            raise ValueError(f"{name}: expected a CUDA tensor, got device {other}")
    for name, other in named_devices.items():
        if other != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got device {other}")


_capabilities: dict[int, tuple[int, int]] = {}


def _device_capability(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = torch.cuda.get_device_capability(index)
    return _capabilities[index]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def check_ranges_enabled() -> bool:
    """Whether ``Q8KV8_CHECK_RANGES=1`` asks for the eager (syncing) value checks. Read on every call."""
    if _ENCODED_ONE is not None:
        try:  # CPython's os.environ keeps the encoded variables in a dict: no KeyError raised when unset
            return os.environ._data.get(_ENCODED_CHECK_RANGES_ENV) == _ENCODED_ONE
        except AttributeError:
            pass
    return os.environ.get(CHECK_RANGES_ENV) == "1"


try:
    _ENCODED_CHECK_RANGES_ENV = os.environ.encodekey(CHECK_RANGES_ENV)
    _ENCODED_ONE = os.environ.encodevalue("1")
except AttributeError:  # not CPython's os._Environ: check_ranges_enabled takes os.environ.get
    _ENCODED_CHECK_RANGES_ENV = _ENCODED_ONE = None


def check_topk_length_range(topk_length: torch.Tensor | None, topk: int, name: str = "topk_length") -> None:
    """Raise ValueError unless every ``topk_length`` value lies in ``[0, topk]`` (the message naming it as
    ``name``). Reads the values: syncs."""
    if topk_length is None or topk_length.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(topk_length))
    if low < 0 or high > topk:
        raise ValueError(
            f"{name}: expected values in [0, {topk}] (0 <= {name} <= topk), got values from {low} "
            f"to {high} (unset {CHECK_RANGES_ENV} to have the kernel clamp them instead)"
        )


def _require_q_dtype(q: tuple) -> None:
    if q[DTYPE] not in Q_DTYPES:
        # SGLang's wording (e4m3 only) follows ours, for code that matches its messages.
        expected = " or ".join(str(dtype) for dtype in Q_DTYPES)
        raise InputTypeError(f"q: expected dtype {expected}, got {q[DTYPE]} (q must be {FP8})")


def _check_no_overlap(outputs: dict[str, tuple], inputs: dict[str, tuple]) -> None:
    """Raise ValueError when an output buffer may share memory with an earlier output or an input (by
    their signatures): one byte interval per tensor (``checks.span``) on one device, the test of
    ``checks.overlaps``.

    A sweep over the intervals sorted by start finds whether any output's interval meets another one;
    only then are they compared in argument order, devices included, for the message."""
    input_spans = [
        (*interval, False, name, tensor[DEVICE])
        for name, tensor in inputs.items()
        if (interval := span(tensor))
    ]
    output_spans = [
        (*interval, True, name, tensor[DEVICE])
        for name, tensor in outputs.items()
        if (interval := span(tensor))
    ]
    max_end = max_output_end = 0  # over the intervals swept so far, and over the outputs among them
    for start, end, is_output, _, _ in sorted(input_spans + output_spans):
        if start < (max_end if is_output else max_output_end):
            break
        max_end = max(max_end, end)
        if is_output:
            max_output_end = max(max_output_end, end)
    else:
        return
    for index, (start, end, _, name, device) in enumerate(output_spans):
        for other_start, other_end, _, other, other_device in output_spans[:index] + input_spans:
            if start < other_end and other_start < end and device == other_device:
                raise ValueError(f"{name}: expected memory of its own, got memory overlapping {other}")
