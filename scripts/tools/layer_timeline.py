"""The GPU timeline of one serving-layer call: each kernel it launches, its duration and the idle gap before
it, against the host time of the call; where a layer costs more than its gather plus its kernel.

Runs ``SparsePrefill.forward`` on the serving benchmark's V3.2 layer (``scripts.bench.serving``: s_q 4096 at
the end of one ``--context`` request, ``--heads`` heads, topk 2048) on each path, warm, then three times more
under ``torch.profiler`` (CUDA activity), each after a device sync, and prints for the last call, per kernel:
its start after the call began on the host, its time and the gap since the previous kernel ended; then the
span from the first kernel's start to the last's end, the kernels' sum and the call's host time.

    python -m scripts.tools.layer_timeline [--context N] [--heads H] [--path workspace,paged]
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--path", default="workspace,paged", help="SparsePrefill paths, comma-separated")
    args = parser.parse_args()

    from q8kv8.serving import SparsePrefill
    from scripts.bench.common import sm90_visible
    from scripts.bench.serving import layer_inputs

    if not sm90_visible():
        print("the layer timeline needs an SM90 GPU", file=sys.stderr)
        return 2
    inputs = layer_inputs(args.context, args.heads)
    for path in args.path.split(","):
        layer = SparsePrefill("fp8", path=path)
        for _ in range(3):  # builds, then warm
            layer.forward(**inputs)
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
