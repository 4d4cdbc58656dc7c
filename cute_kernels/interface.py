"""The attention kernels' launch interface: the constants a caller must agree on with the kernels (no CuTe
DSL import, so that the host package reads them from here without loading the DSL)."""

import math
from typing import NamedTuple

HEAD_ALIGNMENT = 64
"""Query heads per tile (one token's head group, one WGMMA M tile): a token of h heads is ceil(h / 64)
tiles, the last one partly filled when 64 does not divide h."""

SMALL_HEAD_COUNTS = (8, 16, 32)
"""Head counts the small-head kernel runs (a tile is all of one token's heads); any other head count runs
in tiles of ``HEAD_ALIGNMENT`` heads."""

SPLIT_PARTS = (2, 4, 8)
"""Part counts of the split kernel (a tile's index slots over a cluster of that many CTAs, 8 the most a
portable cluster holds): they divide the eight d tiles of out (four per consumer warpgroup), which the parts
share out for the merge."""


class Precision(NamedTuple):
    """What a ``precision`` buys: P kept as two e4m3 terms for the PV product (out of bf16 class), and QK
    summed in float32 every few k-steps (``max_logits`` and ``lse`` to merge by, or to apply a sink to)."""

    p_terms: int  # e4m3 terms P is stored as: 1, or 2 (hi = e4m3(p), lo = e4m3(p - hi))
    qk_in_float32: bool  # S summed in float32 from short WGMMA groups, each started from zero


PRECISIONS = {
    "default": Precision(p_terms=1, qk_in_float32=False),
    "accurate": Precision(p_terms=2, qk_in_float32=True),
    "accurate_out": Precision(p_terms=2, qk_in_float32=False),
    "accurate_logits": Precision(p_terms=1, qk_in_float32=True),
}
"""The kernels' ``precision`` values: "accurate" buys both, "accurate_out" and "accurate_logits" one each."""

TOPK_ALIGNMENT = 128
"""Top-k slots per gathered pair of KV blocks: ``indices.shape[-1]`` must be a multiple."""

SUPPORTED_D_QK = (512, 576)
"""The head dims of q and kv the kernels are built for."""

D_V = 512
"""The head dim of V (``kv[..., :D_V]``) and of ``out``."""

LOG2_E = math.log2(math.e)
"""The kernels take the logit scale in base 2: ``sm_scale * LOG2_E``."""

TOPK_LENGTH_FLAG = 1
"""Bit of the flags argument: ``topk_length`` is given (else a placeholder that is not read)."""

SINK_FLAG = 2
"""Bit of the flags argument: ``attn_sink`` is given (else a placeholder that is not read)."""

SPLIT_TAIL_FLAG = 4
"""Bit of the flags argument: the launch is one of a split tail's two (the one-tile launch of the tokens
before it, then the split launch of its own), which overlap: the first lets its dependent launch start at
once (``griddepcontrol.launch_dependents``), the second is a programmatic dependent launch that reads only
what the first does not write and waits for the first's end before its own (``griddepcontrol.wait``), so
that whatever follows on the stream sees both complete."""
