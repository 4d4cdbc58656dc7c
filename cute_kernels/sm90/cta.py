"""The CTA of the SM90 attention kernels: its shape and its warp roles.

A CTA computes one tile of B_H = 64 query rows (one token, 64 heads: one WGMMA M tile) with three
warpgroups: WG0 the producer (Q by TMA, the KV row gather), WG1 and WG2 the consumers c = 0, 1 (the
MMAs and the softmax; consumer c writes half c of the d_v = 512 output columns).
"""

B_H = 64  # query rows (heads of one token) per CTA
D_V = 512  # value width: the first 512 columns of each KV row
THREADS_PER_WG = 128
NUM_THREADS = 3 * THREADS_PER_WG  # producer + two consumers
CONSUMER_THREADS = 2 * THREADS_PER_WG
