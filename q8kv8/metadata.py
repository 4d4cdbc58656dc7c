"""The sparse prefill's constants (one definition each, read by the Python modules and handed to the C++
extension by ``q8kv8.native``) and the layout helpers for callers: head padding, top-k padding and per-row
top-k lengths."""

import torch

# The kernels' launch interface, defined with the kernels and part of this module's constants.
from cute_kernels.interface import D_V as D_V
from cute_kernels.interface import HEAD_ALIGNMENT as HEAD_ALIGNMENT
from cute_kernels.interface import LOG2_E as LOG2_E
from cute_kernels.interface import PRECISIONS as _KERNEL_PRECISIONS
from cute_kernels.interface import SINK_FLAG as SINK_FLAG
from cute_kernels.interface import SMALL_HEAD_COUNTS as SMALL_HEAD_COUNTS
from cute_kernels.interface import SPLIT_PARTS as SPLIT_PARTS
from cute_kernels.interface import SPLIT_TAIL_FLAG as SPLIT_TAIL_FLAG
from cute_kernels.interface import SUPPORTED_D_QK as SUPPORTED_D_QK
from cute_kernels.interface import TOPK_ALIGNMENT as TOPK_ALIGNMENT
from cute_kernels.interface import TOPK_LENGTH_FLAG as TOPK_LENGTH_FLAG

__version__ = "0.1.0"
"""The package's version (``q8kv8.__version__``; pyproject.toml reads it here)."""

PRECISIONS = tuple(_KERNEL_PRECISIONS)
"""``precision`` values: "default" (P rounded to one e4m3 term for the PV product, S from the FP8 tensor
cores' own sums), "accurate_out" (P kept as two e4m3 terms: out of bf16 class), "accurate_logits" (S summed in
float32 every few k-steps: ``max_logits`` and ``lse`` to merge by), "accurate" (both)."""

LOGITS_IN_FLOAT32 = {
    "default": "accurate_logits",
    "accurate_out": "accurate",
    "accurate_logits": "accurate_logits",
    "accurate": "accurate",
}
"""Each precision with S summed in float32: what runs where the lse weighs the output, since the FP8 tensor
cores' own sums leave the logits of a row led by one slot up to 1% low, and such a row's out takes exp(that)
where a sink is near or above its lse. A call with a sink (out scaled by ``exp(lse) / (exp(lse) +
exp(sink))``) runs it in every path (``q8kv8.kernels.attention_plan``), as do the parts of
``SparsePrefill.forward_merged``, which merge by their lse."""

E4M3_MAX = 448.0
"""The largest finite float8_e4m3fn value; casts to e4m3 saturate at +-E4M3_MAX."""

Q_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)
"""The dtypes ``q`` may have: float8_e4m3fn, dequantised by the per-tensor ``q_scale``, or bfloat16
(``q_scale=None``), which the kernel quantises to e4m3 itself with a power-of-two scale per (token, head)
row (``q8kv8.reference.quantize_q_rows``)."""

ROW_SCALED_Q_DTYPES = (torch.bfloat16,)
"""The dtypes of ``Q_DTYPES`` that the kernel scales per row: a call with such a ``q`` passes no
``q_scale``."""

Q_ALIGNMENT_BYTES = 16
"""The FP8 kernel loads the Q tile in 16-byte units (an e4m3 one by TMA), from a row-major q (e4m3 or bf16):
q's base must be a multiple of this many bytes (else copied)."""

KV_ROW_ALIGNMENT_BYTES = 16
"""The FP8 kernel gathers kv rows with 16-byte copies: kv's base and row stride must be multiples of this many
bytes (else it is copied)."""

OUT_ALIGNMENT_BYTES = 4
"""The FP8 kernel writes ``out`` as bf16 pairs: its base must be a multiple of this many bytes (else the
kernel writes a fresh buffer that is copied back)."""

LAUNCH_ALIGNMENT_BYTES = {"q": Q_ALIGNMENT_BYTES, "kv": KV_ROW_ALIGNMENT_BYTES, "out": OUT_ALIGNMENT_BYTES}
"""The alignment in bytes of the base addresses the FP8 kernel's launch needs, by argument name
(``contract.Problem.launch_ready``, and the C++ fast path's per-call checks)."""


OUTPUTS = ("out", "max_logits", "lse")
"""The outputs of a call, by argument name, in the order ``output_layouts`` gives them."""


def output_layouts(s_q: int, h: int, d_v: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """``(shape, dtype)`` of each of the ``OUTPUTS`` of a call of ``s_q`` tokens and ``h`` heads."""
    stats = (s_q, h)
    return ((s_q, h, d_v), torch.bfloat16), (stats, torch.float32), (stats, torch.float32)


PAD_INDEX = -1
"""The index value ``pad_topk`` appends; any index outside ``[0, s_kv)`` is ignored, -1 is the usual one."""


def small_heads(h_q: int) -> bool:
    """Whether a call with ``h_q`` heads runs the small-head kernel (a tile is all heads of a token)."""
    return h_q in SMALL_HEAD_COUNTS


def head_groups(h_q: int) -> int:
    """The tiles of 64 heads of a token of ``h_q`` heads (not small heads): ceil(h_q / 64)."""
    return -(-h_q // HEAD_ALIGNMENT)


def padded_num_heads(h_q: int) -> int:
    """``h_q`` rounded up to a multiple of 64: the head count of the head-padded Q buffers of SGLang's
    interface (``q8kv8.sglang``). The kernels themselves take any head count as it is."""
    if h_q < 1:
        raise ValueError(f"h_q: expected at least 1 head, got {h_q}")
    return head_groups(h_q) * HEAD_ALIGNMENT


def pad_topk(indices: torch.Tensor) -> torch.Tensor:
    """Pad the last dim of ``indices`` with -1 up to a non-zero multiple of 128.

    Returns ``indices`` itself when its last dim already is one; otherwise a new tensor of the same dtype
    and device whose first ``indices.shape[-1]`` slots are ``indices``.
    """
    topk = indices.shape[-1]
    padded_topk = max(1, -(-topk // TOPK_ALIGNMENT)) * TOPK_ALIGNMENT
    if padded_topk == topk:
        return indices
    padding = indices.new_full((*indices.shape[:-1], padded_topk - topk), PAD_INDEX)
    return torch.cat([indices, padding], dim=-1)


def topk_length_from_seqlens(seqlens: torch.Tensor, topk: int) -> torch.Tensor:
    """Per-row valid-slot count for left-packed ``indices``: ``seqlens`` clamped to ``[0, topk]``, as int32.

    A serving engine that packs each row's valid indices to the front already knows this count (the row's
    number of selected tokens); passing it as ``topk_length`` makes the kernel skip the padded tail, whatever
    values that tail holds. No host sync; the result stays on ``seqlens``'s device.
    """
    if seqlens.is_floating_point() or seqlens.is_complex() or seqlens.dtype == torch.bool:
        raise TypeError(f"seqlens: expected an integer tensor, got dtype {seqlens.dtype}")
    if topk < 0:
        raise ValueError(f"topk: expected a non-negative slot count, got {topk}")
    return seqlens.clamp(0, topk).to(torch.int32)
