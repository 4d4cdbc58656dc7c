"""``make bench``'s schedule section: short prefill chunks and small head counts, with the schedule each ran.

Short chunks (s_q 64, 132, 437, 1024 at h_q 64 and 128; 64k context, d_qk 576, topk 2048): the time and TF/s
of the call as the rules schedule it, its share of the s_q 4096 TF/s of the same head count (timed in the
main table, or here when that row did not run), and the time with the split schedule off (the one-tile kernel)
when the rules split. Head counts (h_q 8, 16, 32, 48, 96 at s_q 4096): the time relative to h_q 64 (and 96 to
128); 8, 16 and 32 run the small-head kernel, 48 and 96 tiles of 64 heads (a token's last one partly
filled).
"""

from __future__ import annotations

import q8kv8
from q8kv8 import eager, schedule
from scripts.bench.common import make_inputs, time_ms

S_KV, D_QK, TOPK = 65536, 576, 2048
CHUNKS = (64, 132, 437, 1024)
CHUNK_HEADS = (64, 128)
FULL_S_Q = 4096
HEADS = (8, 16, 32, 48, 96)


def _tflops(s_q: int, h_q: int, ms: float) -> float:
    return 2.0 * s_q * TOPK * h_q * (D_QK + 512) / ms / 1e9


def _time(s_q: int, h_q: int, rep: int) -> tuple[float, float]:
    inputs = make_inputs(s_q, S_KV, h_q, D_QK, TOPK, None, "cuda")
    call = lambda: q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs)  # noqa: E731
    call()
    ms = time_ms(call, rep)
    return ms, _tflops(s_q, h_q, ms)


def run(rep: int, full_rows: dict[int, float]) -> dict:
    """Print and return the section; ``full_rows``: ms of the s_q 4096 rows (by h_q) the main table timed."""
    full = dict(full_rows)
    for h_q in CHUNK_HEADS:  # also the head-count rows' bases (h_q 64, and 128 for 96)
        if h_q not in full:
            full[h_q] = _time(FULL_S_Q, h_q, rep)[0]
    full_tflops = {h: _tflops(FULL_S_Q, h, ms) for h, ms in full.items()}
    print(f"\nshort chunks (s_kv {S_KV}, d_qk {D_QK}, topk {TOPK}): share of the s_q {FULL_S_Q} TF/s")
    columns = f"{'h_q':>4s} {'s_q':>5s} {'schedule':>32s} | {'ms':>8s} {'TF/s':>6s} {'share':>6s} |"
    print(f"{columns} {'one-tile':>8s} {'x':>5s}")
    chunks = []
    for h_q in CHUNK_HEADS:
        for s_q in CHUNKS:
            chosen = schedule.describe(s_q, h_q, TOPK)
            ms, tflops = _time(s_q, h_q, rep)
            row = {"h_q": h_q, "s_q": s_q, "schedule": chosen, "ms": ms, "tflops": tflops}
            row["share"] = tflops / full_tflops[h_q]
            line = f"{h_q:4d} {s_q:5d} {chosen:>32s} | {ms:8.4f} {tflops:6.0f} {row['share']:6.0%} |"
            if "split" in chosen:  # split, or a split tail: against the one-tile kernel
                with eager.forced_splits(1):
                    row["one_tile_ms"] = _time(s_q, h_q, rep)[0]
                line += f" {row['one_tile_ms']:8.4f} {row['one_tile_ms'] / ms:5.2f}"
            chunks.append(row)
            print(line, flush=True)
    shape = f"s_q {FULL_S_Q}, s_kv {S_KV}, d_qk {D_QK}, topk {TOPK}"
    print(f"\nhead counts ({shape}): time relative to h_q 64 (96: 128)")
    print(f"{'h_q':>4s} {'schedule':>32s} | {'ms':>8s} {'TF/s':>6s} {'x':>5s}")
    heads = []
    for h_q in HEADS:
        ms, tflops = _time(FULL_S_Q, h_q, rep)
        base = full[128 if h_q > 64 else 64]
        row = {"h_q": h_q, "schedule": schedule.describe(FULL_S_Q, h_q, TOPK), "ms": ms, "tflops": tflops}
        row["vs_full"] = ms / base
        heads.append(row)
        print(f"{h_q:4d} {row['schedule']:>32s} | {ms:8.3f} {tflops:6.0f} {row['vs_full']:5.2f}", flush=True)
    return {"full_ms": full, "chunks": chunks, "heads": heads}
