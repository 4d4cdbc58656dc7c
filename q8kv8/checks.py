"""The building blocks of every argument check (``q8kv8.contract``, ``q8kv8.paged``, ``q8kv8.paged_extra``,
``q8kv8.paged_gather``, ``q8kv8.query``, ``q8kv8.serving``): tensor signatures, their byte spans and overlaps,
the type, dtype and shape requirements with their messages, a paged cache's geometry (its layout from the
bytes per token, its page size, base and page stride), and the memos of valid calls' verdicts. Nothing here
reads a tensor's values: nothing syncs with the GPU.

A signature is ``(type, shape, strides, dtype, device, data pointer)`` of a tensor, indexed by ``TYPE``,
``SHAPE``, ``STRIDES``, ``DTYPE``, ``DEVICE`` and ``DATA_PTR``: all that the checks read of it, so a check's
verdict is a function of its arguments' signatures (and scalars) and may be memoised under them.
"""

import torch

from q8kv8.kv_layout import LAYOUT_BY_BYTES_PER_TOKEN, KvCacheLayout
from q8kv8.metadata import KV_ROW_ALIGNMENT_BYTES

FP8 = torch.float8_e4m3fn
TYPE, SHAPE, STRIDES, DTYPE, DEVICE, DATA_PTR = range(6)
OUTPUTS = ("out", "max_logits", "lse")


class InputTypeError(TypeError, ValueError):
    """An argument of the wrong type or dtype. A TypeError, as Python's convention has it, and a ValueError,
    as SGLang's ``sparse_mla_q8kv8_prefill_fwd`` raises for the same calls: code written for either catches
    it."""


def signature(value) -> tuple:
    """``(type, shape, strides, dtype, device, data pointer)`` of a tensor: all that the checks read of
    it; ``(type, None, ...)`` for anything else."""
    try:
        return (type(value), value.shape, value.stride(), value.dtype, value.device, value.data_ptr())
    except Exception:
        if isinstance(value, torch.Tensor):
            raise  # a tensor without strides or storage: torch's own error says so
        return (type(value), None, None, None, None, None)


def rows_signature(num_rows: int, d_qk: int, device: torch.device) -> tuple:
    """The signature of ``num_rows`` contiguous e4m3 rows of ``d_qk`` on ``device`` with no memory of their
    own (data pointer 0): what a paged cache's token slots are to the contract's checks of kv, which then
    judge the rows' count and width (the cache's own bytes are checked by the paged call)."""
    return (torch.Tensor, (num_rows, 1, d_qk), (d_qk, d_qk, 1), FP8, device, 0)


def scalar_signature(device: torch.device) -> tuple:
    """The signature of a one-element float32 tensor on ``device`` with no memory of its own: a scale that
    the call does not take (the paged call's kv_scale, its cache's block scales applying instead)."""
    return (torch.Tensor, (1,), (1,), torch.float32, device, 0)


def require_tensor(name: str, signature: tuple) -> None:
    """``InputTypeError`` unless the signature is a tensor's."""
    if not issubclass(signature[TYPE], torch.Tensor):
        raise InputTypeError(f"{name}: expected a torch.Tensor, got {signature[TYPE].__name__}")


def require_dtype(name: str, signature: tuple, dtype: torch.dtype) -> None:
    """``InputTypeError`` unless the tensor's dtype is ``dtype``."""
    if signature[DTYPE] != dtype:
        # SGLang's wording of the same requirement follows ours, for code that matches its messages.
        if name in OUTPUTS:
            sglang_phrase = f"{name} must have dtype {dtype}"
        elif dtype == FP8:
            sglang_phrase = f"{name} must be {dtype}"
        else:
            sglang_phrase = f"{name} must be {str(dtype).removeprefix('torch.')}"
        raise InputTypeError(f"{name}: expected dtype {dtype}, got {signature[DTYPE]} ({sglang_phrase})")


def require_shape(name: str, signature: tuple, shape: tuple[int, ...], layout: str) -> None:
    """ValueError unless the tensor's shape is ``shape`` (``layout`` names its dims in the message)."""
    if tuple(signature[SHAPE]) != shape:
        raise ValueError(f"{name}: expected shape {layout} = {list(shape)}, got {list(signature[SHAPE])}")


def is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``Tensor.is_contiguous()`` from a shape and strides (size-1 dims may have any stride)."""
    if 0 in shape:
        return True
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def span(signature: tuple) -> tuple[int, int] | None:
    """The half-open byte interval ``(start, end)`` that a tensor's elements may touch, from its signature
    (exactly its bytes when it is contiguous, a superset when strided); None for an empty tensor."""
    _, shape, strides, dtype, _, start = signature
    if 0 in shape:
        return None
    # The offset of the last element, in elements: sum((size - 1) * stride), spelt out for the checks'
    # ranks (a generator expression costs twice as much).
    rank = len(shape)
    if rank == 3:
        (size_0, size_1, size_2), (stride_0, stride_1, stride_2) = shape, strides
        last = (size_0 - 1) * stride_0 + (size_1 - 1) * stride_1 + (size_2 - 1) * stride_2
    elif rank == 2:
        (size_0, size_1), (stride_0, stride_1) = shape, strides
        last = (size_0 - 1) * stride_0 + (size_1 - 1) * stride_1
    elif rank == 1:
        last = (shape[0] - 1) * strides[0]
    else:
        last = sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
    return start, start + (last + 1) * dtype.itemsize


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Conservatively, whether ``a`` and ``b`` may share memory: their byte intervals (``span``) on one
    device meet (empty tensors never overlap)."""
    signature_a, signature_b = signature(a), signature(b)
    span_a, span_b = span(signature_a), span(signature_b)
    return (
        span_a is not None
        and span_b is not None
        and span_a[0] < span_b[1]
        and span_b[0] < span_a[1]
        and signature_a[DEVICE] == signature_b[DEVICE]
    )


def cache_geometry(cache, name: str = "cache") -> tuple[KvCacheLayout, tuple[int, ...]]:
    """``(layout, shape)`` of a paged cache given as ``[num_pages, page_size, 1, bytes_per_token]`` (the
    shape FlashMLA and SGLang use), its layout found by its bytes per token (``q8kv8.kv_layout``), or
    ``InputTypeError`` / ValueError naming it as ``name``. Reads the type and shape only (a traced cache
    has no address). The page size's own requirements are the reader's (``q8kv8.paged``: a power of two;
    ``q8kv8.serving``: at least 1)."""
    require_tensor(name, (type(cache),))
    shape = cache.shape
    if len(shape) != 4 or shape[2] != 1 or shape[3] not in LAYOUT_BY_BYTES_PER_TOKEN:
        raise ValueError(
            f"{name}: expected shape [num_pages, page_size, 1, bytes_per_token] with bytes_per_token in "
            f"{sorted(LAYOUT_BY_BYTES_PER_TOKEN)} (584: V4 / MODEL1, 656: V3.2, 528: V4.1, 288: V4.1 FP4), "
            f"got {list(shape)}"
        )
    return LAYOUT_BY_BYTES_PER_TOKEN[shape[3]], shape


def require_aligned_pages(name: str, data_ptr: int, num_pages: int, page_stride: int) -> None:
    """ValueError unless a paged cache's base and (with more than one page) its page stride are multiples
    of ``KV_ROW_ALIGNMENT_BYTES``: the kernels read its rows that many bytes at a time."""
    if data_ptr % KV_ROW_ALIGNMENT_BYTES or (num_pages > 1 and page_stride % KV_ROW_ALIGNMENT_BYTES):
        raise ValueError(
            f"{name}: expected a {KV_ROW_ALIGNMENT_BYTES}-byte aligned base and page stride (rows are read "
            f"{KV_ROW_ALIGNMENT_BYTES} bytes at a time), got page stride {page_stride} bytes and base offset "
            f"{data_ptr % KV_ROW_ALIGNMENT_BYTES}"
        )


_memos: list[dict] = []


def memo() -> dict:
    """A new memo of valid calls' verdicts (a dict from a key of signatures and scalars to the verdict),
    emptied by ``clear_memos``. Invalid calls are never memoised: only ``remember`` fills a memo."""
    new = {}
    _memos.append(new)
    return new


def remember(memo: dict, key, verdict, entries: int):
    """Store ``verdict`` under ``key`` in ``memo``, first emptying it when it holds ``entries`` keys (a
    bound on the memory of a loop over ever new buffers); returns ``verdict``."""
    if len(memo) >= entries:
        memo.clear()
    memo[key] = verdict
    return verdict


def clear_memos() -> None:
    """Forget every memoised verdict (after a change that the memos' keys do not see: a forced schedule)."""
    for each in _memos:
        each.clear()
