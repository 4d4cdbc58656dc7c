"""Named barrier ids of the SM90 attention kernels (id 0 is ``__syncthreads``)."""

import enum


class NamedBarrierFp8(enum.IntEnum):
    """FP8 kernel (``sparse_prefill``); a per-consumer barrier of consumer c is its member 0 plus c."""

    StatsPublished0 = 3  # one-tile: consumer c's row statistics are in shared memory (c arrives, 1 - c syncs)
    StatsPublished1 = 4  # (persistent: the mbarriers stats_full[c] instead)
    ScaleReady0 = 5  # consumer c's output scales are in shared memory (its own warpgroup)
    ScaleReady1 = 6
    ColumnMax0 = 7  # small heads: consumer c's warps published their S^T block's column maxima
    ColumnMax1 = 8
    RingFree = 9  # split: the consumers' loops and the producer's copies are done (its KV tiles are free)
    WeightsReady = 10  # split: the merge weights of every row are in shared memory (both consumers)
    RopeConverted0 = 11  # paged: consumer c converted its block's staged RoPE (its own warpgroup)
    RopeConverted1 = 12


class NamedBarrierBf16(enum.IntEnum):
    """bf16 kernel (``sparse_prefill_bf16``); each joins both consumer warpgroups."""

    MaxReady = 1  # both consumers published their block's row maxima
    PReady = 2  # both consumers stored their half of P
    SumReady = 3  # both consumers published their row sums (epilogue)
