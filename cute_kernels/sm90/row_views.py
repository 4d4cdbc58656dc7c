"""Row views of the sparse prefill's global tensors, shared by the FP8 and bf16 attention kernels.

The kernels address query rows as (token, head) pairs: ``q`` [s_q, h, d_qk] becomes [s_q * h, d_qk]
(row-major, the TMA source of the Q tiles), ``max_logits`` and ``lse`` [s_q, h] become [s_q * h];
``kv`` [s_kv, 1, d_qk] and ``indices`` [s_q, 1, topk] drop their middle mode and keep their (dynamic)
row strides. ``load_q_tile`` loads one CTA's Q tile from the q view by TMA.
"""

from typing import NamedTuple

import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync


class RowViews(NamedTuple):
    rows: object  # s_q * h, the number of query rows (64 per CTA)
    q: cute.Tensor  # [rows, d_qk]
    kv: cute.Tensor  # [s_kv, d_qk], kv's row stride
    indices: cute.Tensor  # [s_q, topk], indices' row stride
    max_logits: cute.Tensor  # [rows]
    lse: cute.Tensor  # [rows]


def make_row_views(mQ, mKV, mIdx, mMaxLogits, mLse, d_qk: int) -> RowViews:
    """The row views of a launch's tensors (called while tracing a ``@cute.jit`` function)."""
    rows = cute.size(mQ, mode=[0]) * cute.size(mQ, mode=[1])
    return RowViews(
        rows=rows,
        q=cute.make_tensor(mQ.iterator, cute.make_layout((rows, d_qk), stride=(d_qk, 1))),
        kv=cute.make_tensor(
            mKV.iterator, cute.make_layout((cute.size(mKV, mode=[0]), d_qk), stride=(mKV.stride[0], 1))
        ),
        indices=cute.make_tensor(
            mIdx.iterator,
            cute.make_layout(
                (cute.size(mIdx, mode=[0]), cute.size(mIdx, mode=[2])), stride=(mIdx.stride[0], 1)
            ),
        ),
        max_logits=cute.make_tensor(mMaxLogits.iterator, cute.make_layout(rows)),
        lse=cute.make_tensor(mLse.iterator, cute.make_layout(rows)),
    )


def make_q_tma_atom(q_view, sQ_layout, q_shape):
    """The TMA atom and tensor that load ``q_shape`` (rows, d_qk) tiles of the q view into ``sQ_layout``."""
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), q_view, sQ_layout, q_shape)


def load_q_tile(tma_atom_q, mQ_tma, sQ, mbar_q, tile, tile_rows: int, d_qk: int, tile_bytes: int) -> None:
    """Queue the TMA copy of Q tile ``tile`` (rows ``tile * tile_rows`` onwards of the [rows, d_qk] view
    ``mQ_tma``) into ``sQ``, completing on ``mbar_q`` (one elected thread arms it with ``tile_bytes``).
    Called by one warp while tracing the kernel."""
    gQ = cute.local_tile(mQ_tma, (tile_rows, d_qk), (tile, 0))
    tQsQ, tQgQ = cpasync.tma_partition(
        tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
    )
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(mbar_q, tile_bytes)
    cute.copy(tma_atom_q, tQgQ, tQsQ, tma_bar_ptr=mbar_q)
