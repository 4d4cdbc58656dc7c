"""Timing study of the attention variants (both precisions, one-tile and persistent schedules) on bench
shapes.

Builds each variant in-process (not through the cache), checks it against the reference on a few rows,
and prints milliseconds and TF/s per shape. On a machine without an SM90 GPU it only builds them and
prints their ptxas report.

    python -m scripts.tools.schedule_timing [--shapes NAME,...] [--variants NAME,...] [--power SECONDS]

``--power S`` also runs each cell back to back for S seconds while ``nvidia-smi`` samples the board
power and SM clock every 50 ms, and prints their means over the middle half of that window (the H200's
long rows run into its 700 W limit, so a variant's speed and its clock go together).
"""

import argparse
import datetime
import math
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

from q8kv8 import build, eager, kernels, schedule
from scripts.bench.common import SHAPES, check, make_inputs, time_ms

# name: (kernel options, tile schedule)
VARIANTS = {
    "default": {},
    "accurate": {"precision": "accurate"},
    "persist1": {"persistent": True, "tiles_per_cta": 1},
    "persist2": {"persistent": True, "tiles_per_cta": 2},
    "persist4": {"persistent": True, "tiles_per_cta": 4},
    "acc_persist2": {"precision": "accurate", "persistent": True, "tiles_per_cta": 2},
    "acc_persist4": {"precision": "accurate", "persistent": True, "tiles_per_cta": 4},
}


def variant_key(d_qk: int, options: dict) -> kernels.VariantKey:
    """The registry key of a variant's options (``tiles_per_cta`` is a launch argument)."""
    kind = schedule.PERSISTENT if options.get("persistent") else schedule.ONE_TILE
    return kernels.VariantKey(d_qk, options.get("precision", "default"), kind)


def build_variant(d_qk: int, options: dict):
    with tempfile.TemporaryDirectory() as dump:
        compiled = variant_key(d_qk, options).compile(Path(dump))
    with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as ptx:
        ptx.write(compiled.__ptx__)
        ptx.flush()
        variant = build.Variant(
            "experiment", d_qk, "default", compiled, "compiled", 0.0, Path(ptx.name), Path(ptx.name)
        )
        report = build.ptxas_report(variant)
    return compiled, report


class PowerSampler:
    """``nvidia-smi`` samples (time, board power W, SM clock MHz) every 50 ms, read by a thread. It samples
    nvidia-smi's GPU 0, the one the timings run on when one GPU is visible (the GPU machine's case)."""

    def __init__(self):
        query = ["nvidia-smi", "--query-gpu=timestamp,power.draw,clocks.sm", "--format=csv,noheader,nounits"]
        line_buffered = ["stdbuf", "-oL"] if shutil.which("stdbuf") else []  # else samples come late
        self.process = subprocess.Popen(
            [*line_buffered, *query, "-lms", "50", "-i", "0"], stdout=subprocess.PIPE, text=True
        )
        self.samples: list[tuple[float, float, float]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            fields = [f.strip() for f in line.split(",")]
            try:
                stamp = datetime.datetime.strptime(fields[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.samples.append((stamp, float(fields[1]), float(fields[2])))
            except (ValueError, IndexError):
                continue  # a header or "[N/A]"

    def close(self) -> None:
        self.process.terminate()
        self.process.wait()

    def window(self, fn, seconds: float) -> tuple[float, float]:
        """Run ``fn`` back to back for ``seconds``; mean (power, clock) over the window's middle half."""
        start = time.time()
        while time.time() - start < seconds:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
        end = time.time()
        time.sleep(0.3)  # the samples of the window's end arrive
        t0, t1 = start + (end - start) / 4, end - (end - start) / 4
        inside = [(watts, mhz) for stamp, watts, mhz in list(self.samples) if t0 <= stamp <= t1]
        if not inside:
            return math.nan, math.nan
        return sum(w for w, _ in inside) / len(inside), sum(m for _, m in inside) / len(inside)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="h128_kv64k_d576_tk2048")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rep", type=int, default=150)
    parser.add_argument("--power", type=float, default=0.0, help="seconds of steady run per cell")
    args = parser.parse_args()
    gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
    sampler = PowerSampler() if gpu and args.power > 0 else None
    shapes = [s for s in SHAPES if any(w in s[0] for w in args.shapes.split(","))]
    for d_qk in sorted({s[4] for s in shapes}):
        for name in args.variants.split(","):
            options = VARIANTS[name]
            compiled, report = build_variant(d_qk, options)
            serialised = report and "serialized" in report.text
            spills = report and report.spill_store_bytes + report.spill_load_bytes
            print(
                f"d{d_qk} {name:12s} regs {report and report.registers} spills {spills} serial {serialised}"
            )
            if not gpu:
                continue
            precision = options.get("precision", "default")
            # The built kernel replaces the registered variant of its kind; the schedule is forced.
            forced_schedule = eager.forced_tiles_per_cta(
                options.get("tiles_per_cta", 1) if options.get("persistent") else 0
            )
            forced_schedule.__enter__()
            key = variant_key(d_qk, options)
            saved = kernels._variants.get(key)
            kernels._variants[key] = build.Variant(
                name, d_qk, precision, compiled, "compiled", 0.0, Path(), None
            )
            for shape, s_q, s_kv, h_q, dq, topk, tl_mode in shapes:
                if dq != d_qk:
                    continue
                inputs = make_inputs(s_q, s_kv, h_q, d_qk, topk, tl_mode, "cuda")
                tl = inputs["topk_length"]
                flops = 2.0 * (int(tl.long().sum()) if tl is not None else s_q * topk) * h_q * (d_qk + 512)
                import q8kv8

                outputs = q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
                err = check(inputs, outputs, rows=16)

                def call(inputs=inputs, p=precision):
                    return q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs, precision=p)

                ms = time_ms(call, args.rep)
                power = ""
                if sampler is not None:
                    watts, mhz = sampler.window(call, args.power)
                    power = f"  {watts:5.0f} W {mhz:6.0f} MHz"
                print(
                    f"    {shape:30s} {ms:8.3f} ms {flops / ms / 1e9:7.0f} TF/s  rel err {err:.2e}{power}",
                    flush=True,
                )
            if saved is None:
                kernels._variants.pop(key)
            else:
                kernels._variants[key] = saved
            forced_schedule.__exit__(None, None, None)
    if sampler is not None:
        sampler.close()


if __name__ == "__main__":
    main()
