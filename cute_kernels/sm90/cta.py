"""The CTA of the SM90 attention kernels: its shape, warp roles, prologue and launch.

A CTA computes one tile of B_H = 64 query rows (one token, 64 heads: one WGMMA M tile) with three
warpgroups: WG0 the producer (Q by TMA, the KV row gather), WG1 and WG2 the consumers c = 0, 1 (the
MMAs and the softmax; consumer c writes half c of the d_v = 512 output columns). The producer gives
registers to the consumers (``setmaxregister``).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from cute_kernels.interface import HEAD_ALIGNMENT
from cute_kernels.sm90.row_views import make_q_tma_atom, make_row_views
from cute_kernels.sm90.shared_storage import tile_layouts

B_H = HEAD_ALIGNMENT  # query rows (heads of one token) per CTA
THREADS_PER_WG = 128
WARPS_PER_WG = THREADS_PER_WG // 32
NUM_THREADS = 3 * THREADS_PER_WG  # producer + two consumers
CONSUMER_THREADS = 2 * THREADS_PER_WG
PRODUCER_WARPS = WARPS_PER_WG  # warps 0-3; warps 4-7 are consumer 0, warps 8-11 consumer 1


def consumer_index(warp_idx):
    """The consumer (0 or 1) of consumer warp ``warp_idx`` (warp-uniform, so branches on it do not
    diverge)."""
    return warp_idx // PRODUCER_WARPS - 1


@cute.jit
def init_cta(warp_idx, tma_atom_q, init_barriers):
    """The prologue: warp 0 prefetches the Q TMA descriptor (when Q is loaded by TMA: ``tma_atom_q`` not
    None) and one of its threads runs ``init_barriers()`` (mbarrier inits and shared flags), made visible
    to the whole CTA."""
    if warp_idx == 0:
        if cutlass.const_expr(tma_atom_q is not None):
            cpasync.prefetch_descriptor(tma_atom_q)
        with cute.arch.elect_one():
            init_barriers()
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def launch_cta(kernel, grid, stream, cluster=None, use_pdl=False) -> None:
    """Launch ``kernel`` (a ``@cute.kernel`` call) on a ``grid`` ([x, y]) of CTAs of NUM_THREADS threads, in
    clusters of ``cluster`` ([x, y], may be dynamic) CTAs when given, as a programmatic dependent launch when
    ``use_pdl`` (may be dynamic). Dynamic shared memory is the size of the SharedStorage struct it allocates;
    ``min_blocks_per_mp=1`` (without it ``setmaxregister`` is ignored)."""
    if cluster is None:
        kernel.launch(
            grid=[*grid, 1], block=[NUM_THREADS, 1, 1], stream=stream, min_blocks_per_mp=1, use_pdl=use_pdl
        )
    else:
        kernel.launch(
            grid=[*grid, 1],
            block=[NUM_THREADS, 1, 1],
            cluster=[*cluster, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=use_pdl,
        )


class AttentionKernel:
    """Host side of the attention kernel classes. A subclass sets ``d_qk`` and the shapes of its
    shared-memory tiles (``q_shape``, ``k_shape``, ``p_shape``), defines ``shared_storage()`` and
    names its tile atom and element type (``SMEM_ATOM_KIND``, ``ELEMENT_TYPE``)."""

    def shared_memory_bytes(self) -> int:
        """Dynamic shared memory per CTA."""
        return self.shared_storage().size_in_bytes()

    def host_setup(self, mQ, mKV, mIdx, mMaxLogits, mLse, q_by_tma: bool = True):
        """The launch's row views, the swizzled layouts of the Q, KV block and P tiles, and the Q tile's
        TMA atom and tensor (called while tracing ``__call__``; without ``q_by_tma``: no atom, and the q
        row view)."""
        views = make_row_views(mQ, mKV, mIdx, mMaxLogits, mLse, self.d_qk)
        layouts = tile_layouts(
            self.SMEM_ATOM_KIND, self.ELEMENT_TYPE, (self.q_shape, self.k_shape, self.p_shape)
        )
        if not q_by_tma:
            return views, layouts, None, views.q
        tma_atom_q, tma_tensor_q = make_q_tma_atom(views.q, layouts[0], self.q_shape)
        return views, layouts, tma_atom_q, tma_tensor_q
