"""(Timing probe, with the stamps build of this commit.) Per-CTA %globaltimer stamps of the one-tile kernel
with an e4m3 and a bf16 q: ``python -m scripts.probes.one_tile_start_stamps`` on an SM90 GPU."""

import statistics

import torch

import q8kv8
from q8kv8 import eager
from scripts.bench.common import make_inputs

names = {
    1: "consumer start",
    2: "staged Q landed",
    3: "quantised (own)",
    4: "q_full",
    5: "block 0 landed",
    11: "block 1 landed (c1)",
    10: "pair 1 slot free (producer)",
    6: "first S",
    7: "loop end",
    8: "epilogue end",
}
for shape in [(4096, 65536, 128), (4096, 8192, 128), (4096, 65536, 64)]:
    s_q, s_kv, h = shape
    inp = make_inputs(s_q, s_kv, h, 576, 2048, None, "cuda")
    res = {}
    for qd in ("e4m3", "bf16"):
        q, qs = inp["q"], inp["q_scale"]
        if qd == "bf16":
            q, qs = (q.float() * qs).to(torch.bfloat16), None
        with eager.forced_splits(1):
            for _ in range(3):
                out, ml, lse = q8kv8.sparse_mla_q8kv8_prefill_fwd(
                    q, inp["kv"], inp["indices"], inp["sm_scale"], qs, inp["kv_scale"]
                )
            torch.cuda.synchronize()
            st = torch.cuda.Event(enable_timing=True)
            en = torch.cuda.Event(enable_timing=True)
            st.record()
            out, ml, lse = q8kv8.sparse_mla_q8kv8_prefill_fwd(
                q, inp["kv"], inp["indices"], inp["sm_scale"], qs, inp["kv_scale"]
            )
            en.record()
            en.synchronize()
        rows = out.view(-1, 512)[0::64, :48].contiguous().view(torch.int64).cpu()  # [tiles, 12]
        t0 = rows[:, 9]
        rel = {k: (rows[:, k] - t0).double() / 1000 for k in names}
        sm = rows[:, 0]
        # per SM: gap between a CTA's epilogue end and the next CTA's producer start
        gaps = []
        order = torch.argsort(t0)
        last_end = {}
        for i in order.tolist():
            s = int(sm[i])
            if s in last_end:
                gaps.append((int(t0[i]) - last_end[s]) / 1000)
            last_end[s] = int(rows[i, 8])
        span = (rows[:, 8].max() - t0.min()).item() / 1000
        res[qd] = (rel, gaps, span, st.elapsed_time(en) * 1000)
    print(f"\nh {h}, s_kv {s_kv}: us after the producer's start, medians over {rows.shape[0]} CTAs (means)")
    print(
        f"  {'kernel (events) / stamps span':34s} "
        + " ".join(f"{res[q][3]:9.1f} / {res[q][2]:.1f}" for q in res)
    )
    for k, n in names.items():
        print(
            f"  {n:34s} "
            + " ".join(
                f"{statistics.median(res[q][0][k].tolist()):9.2f} ({res[q][0][k].mean():7.2f})" for q in res
            )
        )
    print(
        f"  {'gap to the next CTA on the SM':34s} "
        + " ".join(
            f"{statistics.median(res[q][1]):9.2f} ({sum(res[q][1]) / len(res[q][1]):7.2f})" for q in res
        )
    )
