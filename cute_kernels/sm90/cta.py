"""The CTA of the SM90 attention kernels: its shape, warp roles, prologue and launch.

A CTA computes one tile of B_H = 64 query rows (one token, 64 heads: one WGMMA M tile) with three
warpgroups: WG0 the producer (Q by TMA, the KV row gather), WG1 and WG2 the consumers c = 0, 1 (the
MMAs and the softmax; consumer c writes half c of the d_v = 512 output columns). The producer gives
registers to the consumers (``setmaxregister``).
"""

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

B_H = 64  # query rows (heads of one token) per CTA
D_V = 512  # value width: the first 512 columns of each KV row
THREADS_PER_WG = 128
NUM_THREADS = 3 * THREADS_PER_WG  # producer + two consumers
CONSUMER_THREADS = 2 * THREADS_PER_WG
PRODUCER_WARPS = THREADS_PER_WG // 32  # warps 0-3; warps 4-7 are consumer 0, warps 8-11 consumer 1


def consumer_index(warp_idx):
    """The consumer (0 or 1) of consumer warp ``warp_idx`` (warp-uniform, so branches on it do not
    diverge)."""
    return warp_idx // PRODUCER_WARPS - 1


@cute.jit
def init_cta(warp_idx, tma_atom_q, init_barriers):
    """The prologue: warp 0 prefetches the Q TMA descriptor and one of its threads runs
    ``init_barriers()`` (mbarrier inits and shared flags), made visible to the whole CTA."""
    if warp_idx == 0:
        cpasync.prefetch_descriptor(tma_atom_q)
        with cute.arch.elect_one():
            init_barriers()
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def launch_cta(kernel, num_ctas, stream) -> None:
    """Launch ``kernel`` (a ``@cute.kernel`` call) on ``num_ctas`` CTAs of NUM_THREADS threads. Dynamic
    shared memory is the size of the SharedStorage struct it allocates; ``min_blocks_per_mp=1``
    (without it ``setmaxregister`` is ignored)."""
    kernel.launch(grid=[num_ctas, 1, 1], block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)
