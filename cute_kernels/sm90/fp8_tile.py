"""The FP8 attention kernel's tile geometry (blocks, pairs, the KV ring, the d tiles of O^T, P's scale)
and the ``Consumer`` bundle, shared by the modules that ``SparsePrefillSm90`` (``sparse_prefill.py``) is
built from."""

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Int32

from cute_kernels.sm90.paged_rows import BlockScaleTables
from cute_kernels.sm90.ring import Ring
from cute_kernels.sm90.tile_scheduler import TileWork

B_TOPK = 64  # gathered KV rows per block: the N tile of S and two k-steps of the PV product
PAIR = 2 * B_TOPK  # rows per gathered pair (two blocks, one per producer half)
D_TILES_PER_CONSUMER = 4  # 64-wide d tiles of O^T per consumer (256 of d_v)
NUM_STAGES = 2  # pairs of KV blocks in flight
NUM_KV_TILES = 2 * NUM_STAGES  # block tiles; block b uses tile b % 4 (and P buffer b % 4)
TILE_RING = Ring(1)  # q_full, q_empty, stats_full, tile_done: the CTA's tile i uses phase i % 2
P_SCALE_LOG2 = 7  # P is stored as e4m3(p * 2^7); undone in the epilogue
SW64_TILE_COLS = 64  # bytes per row of one 64-byte-swizzled column tile
TILE_ROW_GROUP_BYTES = B_TOPK * SW64_TILE_COLS  # one [64 rows x 64 B] swizzle column tile


class QkChunks(NamedTuple):
    """The consumer's pieces for S summed in float32 from groups of k-steps (``qk_promoted``) or per scale
    group (``qk_paged``). 64 heads: S in two N = 32 halves through one [64 x 32] chunk accumulator (16
    registers); small heads: a chunk accumulator the shape of S^T."""

    part: cute.Tensor  # the chunk accumulator
    mmas: list = None  # 64 heads: S's N = 32 MMA (accumulating, overwriting); small heads: None
    k_halves: list = None  # 64 heads: the K descriptors of each half; small heads: None
    rope_lo: object = None  # paged, bf16 RoPE: its lo terms' descriptors (64 heads: per half; small: A)


class Consumer(NamedTuple):
    """One consumer warpgroup's view of the CTA (trace-time bundle): who it is, its MMAs and
    fragments, its running softmax state and the shared buffers it exchanges through."""

    index: Int32  # c: owner of blocks c, c + 2, ... (S, P); half c of d_v for O (warp-uniform)
    warp: Int32  # warp inside the warpgroup: rows 16*warp.. of every M tile
    lane: Int32
    quad_row: Int32  # g: C-fragment row inside the warp's 16 rows
    quad_lane: Int32  # t: C-fragment column pair 2t, 2t+1
    work: TileWork
    tiled_mma_qk: cute.TiledMma  # S += Q . K^T
    tiled_mma_qk_first: cute.TiledMma  # S = Q . K^T (first k-step)
    tiled_mma_pv: cute.TiledMma
    tSrQ: cute.Tensor  # Q descriptors (MMA, 1, d_qk/32)
    tSrK: cute.Tensor  # K descriptors (MMA, 1, d_qk/32, tile)
    tOrP: cute.Tensor  # P^T descriptors (MMA, 1, 2 k-steps, term * NUM_KV_TILES + buffer)
    acc_s: cute.Tensor  # S of this consumer's block (32 f32)
    acc_o: list  # O^T, one 64x64 accumulator per d tile (4 x 32 f32)
    thr_mma_pv: cute.ThrMma  # this thread's slice of the PV MMA (V^T fragment shapes)
    row_max_own: cute.Tensor  # per row r: m of this consumer's latest own block (row_sum's base)
    row_max_true: cute.Tensor  # per row r: exact max over own blocks (for max_logits)
    row_sum: cute.Tensor  # per row r: this thread's partial sum of 2^7 P over own blocks
    s_max_used: cute.Tensor  # smem [buffer, row]: m_b, the max P_b is relative to (exp2 domain)
    s_alpha: cute.Tensor  # smem [buffer, row]: alpha_b = 2^(m_{b-1} - m_b)
    s_moved: cute.Tensor  # smem [buffer]: b when m_b != m_{b-1} for some row
    s_max_true: cute.Tensor  # smem [row, consumer]: exact maxima (epilogue)
    s_row_sum: cute.Tensor  # smem [row, consumer]: row sums of 2^7 P, relative to s_max_own
    s_max_own: cute.Tensor  # smem [row, consumer]: the max of the consumer's last own block
    s_out_scale: cute.Tensor  # smem [row, consumer]
    sK_base: Int32  # shared-memory byte address of the gathered KV tiles
    sP_base: Int32  # shared-memory byte address of the P tiles
    mbar_kv_full: cute.Pointer
    mbar_kv_empty: cute.Pointer
    mbar_p_full: cute.Pointer
    mbar_stats_full: cute.Pointer  # persistent: [consumer], see consume_tile (None otherwise)
    mbar_tile_done: cute.Pointer  # persistent: see consume_tile (None otherwise)
    mbar_merge_full: cute.Pointer  # split: completed by the other parts' fragments (None otherwise)
    mbar_peers_free: cute.Pointer  # split: the other parts arrive when their KV tiles are free (else None)
    mIdx: cute.Tensor
    s_kv: object  # kv's rows (Int32); paged: the caches' token slots (``row_gather.SlotBounds``)
    scale_log2: object  # q_scale * kv_scale * sm_scale * log2(e); bf16 q: a pair, row r's with its own scale
    # Small heads only: smem [consumer, buffer, warp, head], the S^T blocks' maxima
    s_column_max: cute.Tensor = None
    s_head_sum: cute.Tensor = None  # small heads: smem [head, 4 consumer + warp], the warps' row sums
    s_column_max_shifted: cute.Tensor = None  # small heads, P carrying the rows' scales: s_column_max of y
    # Small heads: smem [block tile], 64 bits: the validity of its slots, from the producer (produce_tile)
    s_valid_slots: cute.Tensor = None
    qk_chunks: QkChunks = None  # S summed in float32 from groups (qk_promoted) or per scale group (qk_paged)
    rope_lo: cute.Tensor = None  # paged rows rescaled: the RoPE lo terms' descriptors for S (S^T) whole
    tables: BlockScaleTables = None  # paged: the block tiles' scale tables and RoPE staging tiles
