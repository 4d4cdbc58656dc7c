"""``make bench``: time q8kv8's sparse MLA prefill on an SM90 GPU; elsewhere, report the build.

On an H100/H200 it times each shape (median of ``triton.testing.do_bench``, CUDA events otherwise)
for the q8kv8 kernel in every precision ("default"; "accurate" with its time relative to the default in
the main table, "accurate_out" and "accurate_logits" in the precisions table after it, with each one's
errors: ``scripts/bench/precisions.py``), the kernel on a bfloat16 q (the same values: the e4m3 q dequantised
to bf16, which the kernel quantises per row itself; its time relative to the e4m3 q's), those arms timed in
interleaved rounds (median of three, so that their ratios do not depend on where the clocks stand), and a
plain-PyTorch baseline (gather + bf16 matmul + softmax, what one writes without a kernel), prints a table
with TF/s (FLOPs = 2 * sum(valid topk) * h_q * (d_qk + 512)), the host overhead per call, and writes
``bench/out/results.json`` and ``bench/out/results.png`` (or in ``--out DIR``).
Without an SM90 GPU it builds (or loads) the kernel variants for sm_90a, prints their build report, says
on stderr in one line that only the report was produced, and exits with status 2 (``NO_SM90_STATUS``).

Then short prefill chunks and small head counts with the schedule each ran (``scripts/bench/schedules.py``;
none with ``--no-schedules``), and the paged serving path (``scripts/bench/serving.py``): a layer call
(gather + kernel on the bf16 Q) next to the kernel alone and the gather's bandwidth; one layer shape by
default, all of them with ``--serving``, none with ``--no-serving``; and attention straight from the paged
cache (``scripts/bench/paged.py``: prefill chunks, decode, an extra cache, the precisions; a subset of the
chunked-prefill shapes by default, all of them with ``--paged``; none of it with ``--no-paged``).

    python -m scripts.bench [--shapes NAME,...] [--check] [--rep MS] [--no-baseline] [--no-accurate]
                            [--no-bf16q] [--no-schedules] [--[no-]serving] [--[no-]paged] [--jobs N]
                            [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
from pathlib import Path

import torch

import q8kv8  # compiles or loads the kernel variants
from q8kv8 import kernels
from q8kv8.compile import build_in_processes
from q8kv8.metadata import PRECISIONS
from scripts.bench.common import (
    SHAPES,
    check,
    host_us,
    make_inputs,
    sm90_visible,
    time_interleaved_ms,
    time_ms,
)

REPO = Path(__file__).resolve().parent.parent.parent
NO_SM90_STATUS = 2
"""The exit status without an SM90 GPU: the build report was printed, nothing was timed."""
NO_SM90_MESSAGE = (
    "make bench times the kernels on an SM90 GPU; none is visible here: only the build report above was "
    "produced"
)


def compile_report(jobs: int = 1) -> list[dict]:
    """Every listed variant built or loaded (first by ``jobs`` processes when more than one: a fresh cache
    builds in about a minute instead of ten), one row each: where it came from, the seconds, registers,
    spills and shared memory."""
    built = build_in_processes(jobs) if jobs > 1 else {}
    rows = [kernels.describe(variant) for variant in sorted(kernels.listed_variants(), key=lambda v: v.name)]
    for r in rows:
        r["source"], r["seconds"] = built.get(r["name"], (r["source"], r["seconds"]))
    width = max(37, *(len(r["name"]) for r in rows))
    print(f"{'variant':{width}s} {'from':9s} {'time s':>7s} {'regs':>5s} {'spills':>7s} {'smem B':>7s}")
    for r in rows:
        print(
            f"{r['name']:{width}s} {r['source']:9s} {r['seconds']:7.3f} {r['registers']!s:>5s} "
            f"{r['spill_bytes']!s:>7s} {r['shared_memory_bytes']:7d}"
        )
    return rows


def torch_baseline(inputs: dict, chunk_rows: int = 256) -> torch.Tensor:
    """Gather + bf16 matmuls + softmax in PyTorch, chunked over query rows."""
    q, kv, indices = inputs["q"], inputs["kv"][:, 0], inputs["indices"][:, 0]
    s_q, topk = indices.shape
    scale = float(inputs["sm_scale"])
    kv_bf16 = (kv.float() * inputs["kv_scale"]).to(torch.bfloat16)
    q_bf16 = (q.float() * inputs["q_scale"]).to(torch.bfloat16)
    slots = torch.arange(topk, device=q.device)
    out = torch.empty(s_q, q.shape[1], 512, dtype=torch.bfloat16, device=q.device)
    for start in range(0, s_q, chunk_rows):
        rows = slice(start, start + chunk_rows)
        idx = indices[rows].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        if inputs["topk_length"] is not None:
            valid &= slots < inputs["topk_length"][rows, None]
        gathered = kv_bf16[idx.clamp(0, kv.shape[0] - 1)]
        logits = torch.matmul(q_bf16[rows], gathered.transpose(1, 2)).float() * scale
        probs = torch.softmax(logits.masked_fill(~valid[:, None], -math.inf), dim=-1).nan_to_num_(0.0)
        out[rows] = torch.matmul(probs.to(torch.bfloat16), gathered[..., :512])
    return out


def bf16_q_inputs(inputs: dict) -> dict:
    """``inputs`` with the e4m3 q dequantised to bfloat16 and ``q_scale=None`` (the kernel scales each
    row)."""
    q = (inputs["q"].float() * inputs["q_scale"]).to(torch.bfloat16)
    return {**inputs, "q": q, "q_scale": None}


def host_overhead_us(
    calls: int = 500, runs: int = 20, given_buffers: bool = True, bf16_q: bool = False, paged: bool = False
) -> float:
    """Wall time per call of a tiny problem (validation + launch), with the output buffers given or
    allocated by each call, for an e4m3 q or a bfloat16 one, or (``paged``) a paged call of a bfloat16 q on a
    V4.1 cache: the best of ``runs`` runs of ``calls`` launches queued without syncs, after a warm-up. A run
    stays below the launch queue's depth, so the host never waits for the GPU and the number is the host's
    own time."""
    if paged:
        from scripts.bench.paged import make_cache

        q = torch.randn(1, 64, 512, device="cuda").to(torch.bfloat16)
        indices = torch.randint(0, 256, (1, 1, 128), dtype=torch.int32, device="cuda")
        cache = make_cache(256, "v41")
        function = functools.partial(q8kv8.sparse_mla_q8kv8_paged_fwd, q, cache, indices, 0.04)
        inputs = {}
    else:
        inputs = make_inputs(1, 256, 64, 576, 128, None, "cuda")
        if bf16_q:
            inputs = bf16_q_inputs(inputs)
        function = q8kv8.sparse_mla_q8kv8_prefill_fwd
    out = function(**inputs)
    buffers = {"out": out[0], "max_logits": out[1], "lse": out[2]} if given_buffers else {}
    call = functools.partial(function, **inputs, **buffers)
    return host_us(call, calls, runs, warmup=4 * calls)  # warm-up: caches, allocator, CPU clocks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="", help="comma-separated substrings of shape names to run")
    parser.add_argument(
        "--check", action="store_true", help="validate each shape against the reference first"
    )
    parser.add_argument("--rep", type=int, default=300, help="do_bench repetition time per arm, ms")
    parser.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baseline arm")
    parser.add_argument(
        "--jobs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes that build the variants missing from the cache (default: one a core)",
    )
    parser.add_argument(
        "--no-accurate", action="store_true", help='skip the arms of every precision but "default"'
    )
    parser.add_argument("--no-bf16q", action="store_true", help="skip the bfloat16-q arm")
    parser.add_argument(
        "--no-schedules", action="store_true", help="skip the short-chunk and head-count section"
    )
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=str(REPO / "bench" / "out"),
        help="folder for results.json / results.png",
    )
    paged = parser.add_mutually_exclusive_group()
    paged.add_argument(
        "--paged", action="store_true", help="every chunked-prefill shape of the paged section"
    )
    paged.add_argument("--no-paged", action="store_true", help="skip the paged-cache section")
    serving = parser.add_mutually_exclusive_group()
    serving.add_argument("--serving", action="store_true", help="every serving layer shape (paged path)")
    serving.add_argument("--no-serving", action="store_true", help="skip the serving section")
    args = parser.parse_args(argv)

    build = compile_report(args.jobs)
    if not sm90_visible():
        sys.stdout.flush()  # the report first, then the line that says why nothing else follows
        print(NO_SM90_MESSAGE, file=sys.stderr)
        return NO_SM90_STATUS

    gpu = torch.cuda.get_device_name()
    wanted = [s for s in args.shapes.split(",") if s]
    results = []
    header = (
        f"{'shape':30s} {'eff topk':>8s} | {'q8kv8 ms':>9s} {'TF/s':>6s} | {'bf16 q':>9s} {'x':>5s} | "
        f"{'accurate':>9s} {'TF/s':>6s} {'x':>5s} | {'torch ms':>9s} {'TF/s':>6s}"
    )
    header += " | rel err (default, bf16 q, accurate)" if args.check else ""
    print(f"\n{gpu}, {datetime.date.today()}\n{header}")
    for name, s_q, s_kv, h_q, d_qk, topk, tl_mode in SHAPES:
        if wanted and not any(w in name for w in wanted):
            continue
        inputs = make_inputs(s_q, s_kv, h_q, d_qk, topk, tl_mode, "cuda")
        tl = inputs["topk_length"]
        eff = int(tl.long().sum()) if tl is not None else s_q * topk
        flops = 2.0 * eff * h_q * (d_qk + 512)
        row = {"shape": name, "s_q": s_q, "s_kv": s_kv, "h_q": h_q, "d_qk": d_qk, "topk": topk}
        row.update(topk_length=tl_mode, sum_valid_topk=eff, flops=flops)
        # The e4m3-q, bf16-q and other precisions' arms on the same values, timed in interleaved rounds: the
        # ratios between them then hold whatever the clocks do (the first shape's first arm would otherwise
        # run ahead of the power cap).
        arms = [("q8kv8", "default", inputs), ("q8kv8_bf16q", "default", None)]
        arms += [(f"q8kv8_{p}", p, inputs) for p in PRECISIONS if p != "default"]
        calls = {}
        for arm, precision, arm_inputs in arms:
            if (precision != "default" and args.no_accurate) or (arm == "q8kv8_bf16q" and args.no_bf16q):
                continue
            if arm_inputs is None:
                arm_inputs = bf16_q_inputs(inputs)
            calls[arm] = functools.partial(
                q8kv8.sparse_mla_q8kv8_prefill_fwd, **arm_inputs, precision=precision
            )
            outputs = calls[arm]()
            row[arm] = {}
            if args.check:  # for the bf16 q: against the reference on its rows quantised as the kernel does
                row[arm]["rel_err"] = check(arm_inputs, outputs)
            del outputs
        for arm, ms in time_interleaved_ms(calls, args.rep).items():
            row[arm].update(ms=ms, tflops=flops / ms / 1e9)
        ms = row["q8kv8"]["ms"]
        if "q8kv8_bf16q" in row:
            row["q8kv8_bf16q"]["vs_fp8q"] = row["q8kv8_bf16q"]["ms"] / ms
        if not args.no_baseline:
            base_ms = time_ms(lambda inputs=inputs: torch_baseline(inputs), max(args.rep // 3, 50))
            row["torch"] = {"ms": base_ms, "tflops": flops / base_ms / 1e9}
        results.append(row)
        base = row.get("torch", {"ms": math.nan, "tflops": math.nan})
        acc = row.get("q8kv8_accurate", {"ms": math.nan, "tflops": math.nan, "rel_err": math.nan})
        bf16q = row.get("q8kv8_bf16q", {"ms": math.nan, "vs_fp8q": math.nan, "rel_err": math.nan})
        line = (
            f"{name:30s} {eff / s_q:8.0f} | {ms:9.3f} {row['q8kv8']['tflops']:6.0f} | "
            f"{bf16q['ms']:9.3f} {bf16q['vs_fp8q']:5.2f} | "
            f"{acc['ms']:9.3f} {acc['tflops']:6.0f} {acc['ms'] / ms:5.2f} | "
            f"{base['ms']:9.3f} {base['tflops']:6.0f}"
        )
        if args.check:
            line += (
                f" | {row['q8kv8']['rel_err']:.2e}, {bf16q.get('rel_err', math.nan):.2e}, "
                f"{acc.get('rel_err', math.nan):.2e}"
            )
        print(line, flush=True)
        del inputs
    if not args.no_accurate:
        from scripts.bench import precisions

        precisions.print_times(results)
        precisions_report = {"errors": precisions.error_rows()}

    overhead = host_overhead_us()
    overhead_allocating = host_overhead_us(given_buffers=False)
    print(
        f"\nhost overhead per call (validation + launch, tiny shape): {overhead:.1f} us with output buffers "
        f"given, {overhead_allocating:.1f} us allocating them"
    )
    report = {"gpu": gpu, "date": str(datetime.date.today()), "build": build, "shapes": results}
    if not args.no_accurate:
        report["precisions"] = precisions_report
    report["host_overhead_us"] = overhead
    report["host_overhead_allocating_us"] = overhead_allocating
    if not args.no_bf16q:
        report["host_overhead_bf16q_us"] = host_overhead_us(bf16_q=True)
        report["host_overhead_bf16q_allocating_us"] = host_overhead_us(given_buffers=False, bf16_q=True)
        print(
            f"the same for a bfloat16 q: {report['host_overhead_bf16q_us']:.1f} us with output buffers "
            f"given, {report['host_overhead_bf16q_allocating_us']:.1f} us allocating them"
        )
    report["host_overhead_paged_us"] = host_overhead_us(paged=True)
    report["host_overhead_paged_allocating_us"] = host_overhead_us(given_buffers=False, paged=True)
    print(
        f"a paged call (V4.1 cache, bfloat16 q): {report['host_overhead_paged_us']:.1f} us with output "
        f"buffers given, {report['host_overhead_paged_allocating_us']:.1f} us allocating them"
    )
    if not args.no_schedules:
        from scripts.bench import schedules

        full_rows = {
            row["h_q"]: row["q8kv8"]["ms"]
            for row in results
            if (row["s_q"], row["s_kv"], row["d_qk"], row["topk"], row["topk_length"])
            == (schedules.FULL_S_Q, schedules.S_KV, schedules.D_QK, schedules.TOPK, None)
        }
        report["schedules"] = schedules.run(args.rep, full_rows)
    if not args.no_serving:
        from scripts.bench import serving

        report["serving"] = serving.run(args.rep, full=args.serving)
    if not args.no_paged:
        from scripts.bench import paged as paged_section

        report["paged"] = paged_section.run(args.rep, full=args.paged)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "results.png")
    return 0


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart")
        return
    shapes = report["shapes"]
    arms = [
        arm for arm in ("q8kv8", "q8kv8_bf16q", "q8kv8_accurate", "torch") if any(arm in s for s in shapes)
    ]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(shapes)), 4))
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        values = [s[arm]["tflops"] if arm in s else 0 for s in shapes]
        ax.bar([x + i * width for x in range(len(shapes))], values, width, label=arm)
    ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(shapes))])
    ax.set_xticklabels([s["shape"] for s in shapes], rotation=20, ha="right", fontsize=7)
    ax.set_ylabel("TF/s")
    ax.set_title(f"sparse MLA prefill, {report['gpu']}, {report['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
