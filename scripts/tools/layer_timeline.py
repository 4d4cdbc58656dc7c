"""The GPU timeline of one serving-layer call: each kernel it launches, its duration and the idle gap before
it, against the host time of the call; where a layer costs more than its gather plus its kernel.

Runs ``SparsePrefill.forward`` on the serving benchmark's V3.2 layer (``scripts.bench.serving``: s_q 4096 at
the end of one ``--context`` request, ``--heads`` heads, topk 2048) on each path, warm, then three times more
under ``torch.profiler`` (CUDA activity), each after a device sync, and prints for the last call, per kernel:
its start after the call began on the host, its time and the gap since the previous kernel ended; then the
span from the first kernel's start to the last's end, the kernels' sum and the call's host time.
``--back-to-back``: the calls queued without syncs, as a serving loop runs them (the host ahead of the GPU
unless its time per call exceeds the GPU's): the last two calls' kernels with the gap before each, and the
GPU time per call (CUDA events over 20 calls) beside the host time per call.

    python -m scripts.tools.layer_timeline [--context N] [--heads H] [--s-q N] [--path workspace,paged]
        [--back-to-back]
"""

from __future__ import annotations

import argparse
import sys
from typing import NamedTuple

NAME_WIDTH = 48


class KernelSpan(NamedTuple):
    """One GPU kernel of the timeline, times in us from the host's start of the call."""

    name: str
    start_us: float
    duration_us: float


def timeline_rows(kernels: list[KernelSpan]) -> list[dict]:
    """``kernels`` in order of start, each with the idle gap before it (from the previous kernel's end; the
    first: from the host's start of the call)."""
    rows, end = [], 0.0
    for k in sorted(kernels, key=lambda k: k.start_us):
        rows.append({"name": k.name, "start_us": k.start_us, "us": k.duration_us, "gap_us": k.start_us - end})
        end = max(end, k.start_us + k.duration_us)
    return rows


def summary(rows: list[dict]) -> dict:
    """The span from the first kernel's start to the last one's end, the kernels' sum and the gaps between
    them (the first kernel's lead from the host's start not counted)."""
    if not rows:
        return {"span_us": 0.0, "kernels_us": 0.0, "gaps_us": 0.0}
    span = max(r["start_us"] + r["us"] for r in rows) - rows[0]["start_us"]
    return {
        "span_us": span,
        "kernels_us": sum(r["us"] for r in rows),
        "gaps_us": sum(r["gap_us"] for r in rows[1:]),
    }


def format_rows(rows: list[dict]) -> list[str]:
    lines = [f"{'kernel':{NAME_WIDTH}s} {'start us':>9s} {'us':>9s} {'gap us':>8s}"]
    for r in rows:
        name = r["name"] if len(r["name"]) <= NAME_WIDTH else r["name"][: NAME_WIDTH - 3] + "..."
        lines.append(f"{name:{NAME_WIDTH}s} {r['start_us']:9.1f} {r['us']:9.1f} {r['gap_us']:8.1f}")
    return lines


def profile_call(call, calls: int = 3) -> tuple[list[KernelSpan], float]:
    """The kernels of the last of ``calls`` calls of ``call()`` (already warm), each after a device sync, and
    its host time, us, from ``torch.profiler`` (the profiler's own start-up delays its first launches)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            with record_function("layer_call"):
                call()
        torch.cuda.synchronize()
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    hosts = [e for e in events if e.name == "layer_call" and e.device_type != cuda]
    host = max(hosts, key=lambda e: e.time_range.start)
    origin, end = host.time_range.start, host.time_range.end
    kernels = [  # the last call's kernels: from its host start to the next sync; range annotations left out
        KernelSpan(e.name, e.time_range.start - origin, e.time_range.elapsed_us())
        for e in events
        if e.device_type == cuda
        and e.name != "layer_call"
        and not getattr(e, "is_user_annotation", False)
        and e.time_range.start >= origin
    ]
    return kernels, end - origin


def back_to_back(call, calls: int = 6) -> list[KernelSpan]:
    """The kernels of ``calls`` calls of ``call()`` queued without syncs (already warm), times in us from the
    first kernel's start."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [
        e for e in prof.events() if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
    ]
    origin = min((e.time_range.start for e in events), default=0.0)
    return [KernelSpan(e.name, e.time_range.start - origin, e.time_range.elapsed_us()) for e in events]


def per_call_us(call, calls: int = 20) -> tuple[float, float]:
    """``(host us, GPU us)`` per call of ``calls`` calls queued without syncs: the host's time to queue them,
    and the GPU's from the first launch to the last kernel's end (CUDA events)."""
    import time

    import torch

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - began) / calls * 1e6
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) / calls * 1e3


def print_back_to_back(path: str, args, inputs: dict, call, calls: int = 6) -> None:
    """``--back-to-back``: the last two of ``calls`` queued calls' kernels, then the time per call."""
    host_us, gpu_us = per_call_us(call)  # before the profiler, whose hooks slow the launches after it
    kernels = back_to_back(call, calls)
    rows = timeline_rows(kernels)[-2 * (len(kernels) // calls) :]
    shape = f"context {args.context}, h {args.heads}, s_q {inputs['q'].shape[0]}"
    print(f"\n{path}, back to back: {shape}")
    print("\n".join(format_rows(rows)))
    gaps = sum(r["gap_us"] for r in rows[1:])
    print(f"per call: GPU {gpu_us:.1f} us, host {host_us:.1f} us; gaps in the last two calls {gaps:.1f} us")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--s-q", type=int, default=None, help="the chunk's tokens (default: the benchmark's)")
    parser.add_argument("--path", default="workspace,paged", help="SparsePrefill paths, comma-separated")
    parser.add_argument("--back-to-back", action="store_true", help="calls queued without syncs")
    args = parser.parse_args()

    from q8kv8.serving import SparsePrefill
    from scripts.bench.common import sm90_visible
    from scripts.bench.serving import layer_inputs

    if not sm90_visible():
        print("the layer timeline needs an SM90 GPU", file=sys.stderr)
        return 2
    inputs = layer_inputs(args.context, args.heads, s_q=args.s_q)
    for path in args.path.split(","):
        layer = SparsePrefill("fp8", path=path)
        for _ in range(3):  # builds, then warm
            layer.forward(**inputs)
        if args.back_to_back:
            print_back_to_back(path, args, inputs, lambda layer=layer: layer.forward(**inputs))
            continue
        kernels, host_us = profile_call(lambda layer=layer: layer.forward(**inputs))
        rows = timeline_rows(kernels)
        total = summary(rows)
        print(f"\n{path}: context {args.context}, h {args.heads}, s_q {inputs['q'].shape[0]}")
        print("\n".join(format_rows(rows)))
        print(
            f"span {total['span_us']:.1f} us = kernels {total['kernels_us']:.1f} "
            f"+ gaps {total['gaps_us']:.1f}; host {host_us:.1f} us"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
