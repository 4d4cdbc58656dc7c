"""The paged serving path on an SM90 GPU: one layer call (gather + the FP8 kernel on the layer's bf16 Q,
which it quantises per row) next to the kernel alone (on an e4m3 Q cast with one per-tensor scale, and on
the bf16 Q), and the gather kernel's bandwidth against a PyTorch copy of the same bytes.

Layer shapes: s_q 4096 queries at the end of one request of ``context`` tokens (8k, 32k, 64k), h 64
and 128, DeepSeek V3.2 cache layout (656 bytes per token, d_qk 576), pages of 64 tokens at random
slots, topk 2048 distinct random rows per query (all valid). The bf16 backend's columns (layer
call and kernel alone) appear when ``q8kv8.kernels.launch_sparse_prefill_bf16`` exists. Called by
``python -m scripts.bench`` (a light subset by default, all shapes with ``--serving``); on its own:

    python -m scripts.bench.serving [--light] [--rep MS]
"""

from __future__ import annotations

import sys

import torch

from q8kv8 import kernels, sparse_mla_q8kv8_prefill_fwd
from q8kv8.paged_gather import gather_dequant_paged
from q8kv8.query import cast_q_fp8, dynamic_q_scale
from q8kv8.serving import SparsePrefill, topk_length_for
from scripts.bench.common import random_indices, section_args, time_interleaved_ms, time_ms

PAGE_SIZE = 64
TOPK = 2048
S_Q = 4096
D_QK = 576
LAYER_SHAPES = [(context, h) for context in (8192, 32768, 65536) for h in (64, 128)]
LIGHT_LAYER_SHAPES = [(65536, 128)]
GATHER_TOKENS = 1 << 20
V32_BYTES_PER_TOKEN = 656


def make_v32_cache(num_slots: int, device, std: float = 0.1) -> torch.Tensor:
    """``[num_pages, 64, 1, 656]`` uint8 holding normal(0, std) tokens quantised as V3.2 does."""
    num_pages = -(-num_slots // PAGE_SIZE)
    records = torch.empty(num_pages * PAGE_SIZE, V32_BYTES_PER_TOKEN, dtype=torch.uint8, device=device)
    for start in range(0, records.shape[0], 1 << 18):  # bounded float32 temporaries
        x = torch.randn(min(1 << 18, records.shape[0] - start), D_QK, device=device) * std
        tiles = x[:, :512].reshape(-1, 4, 128)
        scales = tiles.abs().amax(dim=-1).clamp_min(1e-4) / 448.0
        nope = (tiles / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        chunk = records[start : start + x.shape[0]]
        chunk[:, :512] = nope.view(torch.uint8).reshape(-1, 512)
        chunk[:, 512:528] = scales.contiguous().view(torch.uint8)
        chunk[:, 528:] = x[:, 512:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return records.view(num_pages, PAGE_SIZE, 1, V32_BYTES_PER_TOKEN)


def layer_inputs(context: int, h: int, device="cuda", s_q: int | None = None) -> dict:
    """One layer call's inputs: ``s_q`` (default ``S_Q``) tokens at the end of one request of ``context``
    tokens, ``h`` heads, on a V3.2 cache whose request pages are random."""
    s_q = S_Q if s_q is None else s_q
    torch.manual_seed(0)
    num_slots = context + context // 4  # a cache with unused slots; the request's pages are random
    cache = make_v32_cache(num_slots, device)
    return {
        "q": (torch.randn(s_q, h, D_QK, device=device) * 0.5).to(torch.bfloat16),
        "cache": cache,
        "page_table": torch.randperm(cache.shape[0] * PAGE_SIZE, device=device)[:context].to(torch.int32),
        "indices": random_indices(s_q, context, TOPK, device),
        "seqlens": torch.arange(context - s_q + 1, context + 1, dtype=torch.int32, device=device),
        "compress_ratio": 0,
        "sm_scale": D_QK**-0.5,
    }


def bench_layer(context: int, h: int, rep_ms: int) -> dict:
    inputs = layer_inputs(context, h)
    flops = 2.0 * S_Q * TOPK * h * (D_QK + 512)
    row = {"context": context, "h": h, "s_q": S_Q, "topk": TOPK, "layout": "v32", "flops": flops}

    prefill = SparsePrefill("fp8", path="workspace")
    prefill.forward(**inputs)  # builds the kernels and the workspace
    paged = SparsePrefill("fp8", path="paged")
    paged.forward(**inputs)

    # The same work piece by piece, on the same buffers: the kernel on an e4m3 Q (cast with one per-tensor
    # scale) and on the layer's bf16 Q; and the bf16 backend's layer and kernel. The arms are timed in
    # interleaved rounds (a layer/kernel ratio is not to depend on which arm ran first, before the clocks
    # settle at the power cap).
    q, cache, page_table = inputs["q"], inputs["cache"], inputs["page_table"]
    kv = prefill.workspace.get(context, torch.float8_e4m3fn)
    q_scale = dynamic_q_scale(q)
    q8 = cast_q_fp8(q, q_scale)
    indices = inputs["indices"][:, None, :]
    topk_length = topk_length_for(inputs["seqlens"], 0, TOPK)
    one = torch.ones(1, dtype=torch.float32, device=q.device)
    sm_scale = inputs["sm_scale"]
    arms = {
        "layer_fp8_ms": lambda: prefill.forward(**inputs),
        "layer_paged_ms": lambda: paged.forward(**inputs),
        "kernel_ms": lambda: sparse_mla_q8kv8_prefill_fwd(
            q8, kv, indices, sm_scale, q_scale, one, 512, None, topk_length
        ),
        "kernel_bf16q_ms": lambda: sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, sm_scale, None, one, 512, None, topk_length
        ),
        "gather_ms": lambda: gather_dequant_paged(
            cache, page_table, PAGE_SIZE, "v32", torch.float8_e4m3fn, 0, kv
        ),
        "q_cast_ms": lambda: cast_q_fp8(q, q_scale, q8),
    }
    if hasattr(kernels, "launch_sparse_prefill_bf16"):
        prefill_bf16 = SparsePrefill("bf16")
        prefill_bf16.forward(**inputs)
        # The bf16 kernel alone, on the rows the layer call gathered.
        kv16 = prefill_bf16.workspace.get(context, torch.bfloat16)
        out16 = torch.empty(S_Q, h, 512, dtype=torch.bfloat16, device=q.device)
        max16 = torch.empty(S_Q, h, dtype=torch.float32, device=q.device)
        lse16 = torch.empty_like(max16)
        arms["layer_bf16_ms"] = lambda: prefill_bf16.forward(**inputs)
        arms["kernel_bf16_ms"] = lambda: kernels.launch_sparse_prefill_bf16(
            q, kv16, indices, topk_length, None, sm_scale, out16, max16, lse16
        )
    row.update(time_interleaved_ms(arms, rep_ms))
    gathered_bytes = context * (V32_BYTES_PER_TOKEN + 4 + D_QK)
    row["gather_gbps"] = gathered_bytes / row["gather_ms"] / 1e6
    return row


def bench_gather_bandwidth(rep_ms: int, num_tokens: int | None = None) -> dict:
    """Gather of ``num_tokens`` random slots (read 656 + 4 bytes, write 576 or 1152 per token) against
    ``torch`` copying the same cache bytes (read and write 656 bytes per token)."""
    num_tokens = GATHER_TOKENS if num_tokens is None else num_tokens
    torch.manual_seed(0)
    cache = make_v32_cache(num_tokens, "cuda")
    result = {"tokens": num_tokens}
    for order in ("random", "sequential"):
        slots = torch.arange(num_tokens, device="cuda", dtype=torch.int32)
        if order == "random":
            slots = slots[torch.randperm(num_tokens, device="cuda")]
        for name, dtype in (("e4m3", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
            out = torch.empty(num_tokens, 1, D_QK, dtype=dtype, device="cuda")
            ms = time_ms(
                lambda slots=slots, dtype=dtype, out=out: gather_dequant_paged(
                    cache, slots, PAGE_SIZE, "v32", dtype, 0, out
                ),
                rep_ms,
            )
            moved = num_tokens * (V32_BYTES_PER_TOKEN + 4 + D_QK * out.element_size())
            result[f"gather_{order}_{name}"] = {"ms": ms, "gbps": moved / ms / 1e6}
    source = cache.reshape(-1)[: num_tokens * V32_BYTES_PER_TOKEN]
    target = torch.empty_like(source)
    ms = time_ms(lambda: target.copy_(source), rep_ms)
    result["torch_copy"] = {"ms": ms, "gbps": 2 * source.numel() / ms / 1e6}
    return result


def run(rep_ms: int = 300, full: bool = False) -> dict:
    """Print and return the serving tables (``full``: every layer shape, else the light subset)."""
    shapes = LAYER_SHAPES if full else LIGHT_LAYER_SHAPES
    print(
        f"\nserving: V3.2 paged cache (page {PAGE_SIZE}), s_q {S_Q}, topk {TOPK}, d_qk {D_QK}; ms (TF/s); "
        "kernel: on an e4m3 Q; layer fp8: the workspace path, paged: straight from the cache; x: over "
        "kernel; "
        "kernel bf16q: on the layer's bf16 Q; q cast: e4m3 Q's"
    )
    header = (
        f"{'context':>7s} {'h':>4s} | {'kernel':>14s} | {'layer fp8':>14s} {'x':>5s} | "
        f"{'paged':>14s} {'x':>5s} | "
        f"{'kernel bf16q':>14s} | {'gather':>7s} {'GB/s':>6s} | {'q cast':>7s} | {'layer bf16':>14s} | "
        f"{'kernel bf16':>14s}"
    )
    print(header)
    rows = []
    for context, h in shapes:
        row = bench_layer(context, h, rep_ms)
        rows.append(row)

        def rate(ms, row=row):
            return f"{ms:7.3f} ({row['flops'] / ms / 1e9:4.0f})"

        bf16 = rate(row["layer_bf16_ms"]) if "layer_bf16_ms" in row else f"{'n/a':>14s}"
        kernel_bf16 = rate(row["kernel_bf16_ms"]) if "kernel_bf16_ms" in row else f"{'n/a':>14s}"
        ratio = row["layer_fp8_ms"] / row["kernel_ms"]  # the layer over the e4m3-q kernel alone
        paged_ratio = row["layer_paged_ms"] / row["kernel_ms"]
        print(
            f"{context:7d} {h:4d} | {rate(row['kernel_ms'])} | {rate(row['layer_fp8_ms'])} {ratio:5.2f} | "
            f"{rate(row['layer_paged_ms'])} {paged_ratio:5.2f} | "
            f"{rate(row['kernel_bf16q_ms'])} | {row['gather_ms']:7.3f} {row['gather_gbps']:6.0f} | "
            f"{row['q_cast_ms']:7.3f} | {bf16} | {kernel_bf16}",
            flush=True,
        )
        torch.cuda.empty_cache()
    bandwidth = bench_gather_bandwidth(rep_ms)
    print(f"\ngather bandwidth, {bandwidth['tokens']} V3.2 tokens (read + written bytes):")
    for key, value in bandwidth.items():
        if isinstance(value, dict):
            print(f"  {key:24s} {value['ms']:8.3f} ms {value['gbps']:7.0f} GB/s")
    return {"layers": rows, "gather_bandwidth": bandwidth}


def main() -> int:
    args = section_args(__doc__, 300, "--light", "only the 64k-context, h 128 layer shape", "serving")
    if args is None:
        return 2
    run(args.rep, full=not args.light)
    return 0


if __name__ == "__main__":
    sys.exit(main())
