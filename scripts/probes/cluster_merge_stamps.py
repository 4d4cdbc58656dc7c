"""Timing probe of the cluster merge (this build only): %globaltimer stamps of consumer 0's thread 0 per CTA
around each wait of the split epilogue, %clock64 stamps around the fragment sends and after each row group of
the merge; the kernel leaves them in out's head rows 0 and 1 over the part's first owned d columns.
Run: python -m scripts.probes.cluster_merge_stamps (H200; the split variant of d_qk 576, default, e4m3 q)."""

import torch

import q8kv8
from q8kv8 import eager, native
from scripts.bench.common import make_inputs

with native.suspended():
    for s_q, splits, topk in ((64, 2, 2048), (8, 4, 2048)):
        inp = make_inputs(s_q, 65536, 64, 576, topk, None, "cuda")
        out = torch.empty(s_q, 64, 512, dtype=torch.bfloat16, device="cuda")
        with eager.forced_splits(splits):

            def fn():
                return q8kv8.sparse_mla_q8kv8_prefill_fwd(**inp, out=out)

            for _ in range(15):
                fn()
            torch.cuda.synchronize()
        raw = out.view(torch.int64).view(s_q, 64, 128)[:, :2].cpu()
        tpp = 4 // splits
        st = torch.stack(
            [
                torch.cat(
                    [
                        raw[:, 0, p * tpp * 16 : p * tpp * 16 + 11],
                        raw[:, 1, p * tpp * 16 : p * tpp * 16 + 11],
                    ],
                    1,
                )
                for p in range(splits)
            ],
            1,
        ).double()
        ghz = (st[..., 21] - st[..., 11]) / (st[..., 10] - st[..., 6])
        print(f"s_q {s_q} splits {splits}: clock {ghz.median().item():.2f} GHz (median)")

        def show(name, v):
            v = v.flatten()
            print(
                f"   {name:28s} median {v.median().item():8.0f}  max {v.max().item():8.0f}  min {v.min().item():8.0f} cycles"
            )

        show("frag send", st[..., 12] - st[..., 11])
        show("merge_full wait+weights", st[..., 13] - st[..., 12])
        prev = st[..., 13]
        for j in range(8):
            show(f"merge j={j}", st[..., 14 + j] - prev)
            prev = st[..., 14 + j]
        show("merge total", st[..., 21] - st[..., 13])
        show("(globaltimer ns) merge", st[..., 10] - st[..., 9])
        show("(globaltimer ns) loop", st[..., 2] - st[..., 0])
        for name, a, b in (
            ("producer + consumer 1 (RingFree)", 3, 4),
            ("peers_free", 4, 5),
            ("row_scale", 5, 6),
            ("fragments sent", 6, 7),
            ("merge_full", 7, 8),
            ("weights", 8, 9),
        ):
            show(f"(globaltimer ns) {name}", st[..., b] - st[..., a])
