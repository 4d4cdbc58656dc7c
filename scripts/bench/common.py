"""What the benchmarks share: the benchmark shapes, their inputs, timing and the accuracy check."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch

from q8kv8.reference import sparse_mla_prefill_reference

# name, s_q, s_kv, h_q, d_qk, topk, topk_length mode
SHAPES = [
    ("h128_kv64k_d576_tk2048", 4096, 65536, 128, 576, 2048, None),
    ("h64_kv64k_d576_tk2048", 4096, 65536, 64, 576, 2048, None),
    ("h128_kv8k_d576_tk2048", 4096, 8192, 128, 576, 2048, None),
    ("h64_kv32k_d512_tk512", 4096, 32768, 64, 512, 512, None),
    ("h64_kv64k_d576_tk2048_tlhalf", 4096, 65536, 64, 576, 2048, "half"),
    ("h64_kv64k_d576_tk2048_tlq", 4096, 65536, 64, 576, 2048, "le_quarter"),
]


def random_indices(s_q: int, s_kv: int, topk: int, device, chunk: int = 256) -> torch.Tensor:
    """Distinct random indices in [0, s_kv) per row, in random order (as the peers' benchmark)."""
    out = torch.empty(s_q, topk, dtype=torch.int32, device=device)
    for start in range(0, s_q, chunk):
        r = torch.rand(min(chunk, s_q - start), s_kv, device=device)
        out[start : start + r.shape[0]] = r.topk(topk, dim=1, sorted=False).indices.to(torch.int32)
    return out


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (x.float().abs().amax().clamp_min(1e-4) / 448.0).reshape(1)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def make_inputs(s_q, s_kv, h_q, d_qk, topk, tl_mode, device) -> dict:
    torch.manual_seed(0)
    q, q_scale = quantize(torch.randn(s_q, h_q, d_qk, device=device) / 10)
    kv, kv_scale = quantize(torch.randn(s_kv, 1, d_qk, device=device) / 10)
    topk_length = None
    if tl_mode == "half":
        topk_length = torch.full((s_q,), topk // 2, dtype=torch.int32, device=device)
    elif tl_mode == "le_quarter":
        topk_length = torch.randint(1, topk // 4 + 1, (s_q,), dtype=torch.int32, device=device)
    return {
        "q": q,
        "kv": kv,
        "indices": random_indices(s_q, s_kv, topk, device).view(s_q, 1, topk),
        "sm_scale": d_qk**-0.5,
        "q_scale": q_scale,
        "kv_scale": kv_scale,
        "topk_length": topk_length,
    }


def time_ms(fn, rep_ms: int) -> float:
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    except ImportError:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median_high(times)


def host_us(fn, calls: int, runs: int = 1, warmup: int = 1) -> float:
    """The host's time per call of ``fn``: the best of ``runs`` runs of ``calls`` calls issued back to back
    without syncs (the GPU's launch queue absorbs them), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    best = math.inf
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return best / calls * 1e6


def time_interleaved_ms(arms: dict, rep_ms: int, rounds: int = 3) -> dict:
    """``{name: ms}`` for the callables of ``arms``, timed in ``rounds`` interleaved rounds (each arm
    ``rep_ms / rounds`` per round, in turn) and reduced to the median of its rounds: the arms then see
    the same clocks, which drift with power over a run."""
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            times[name].append(time_ms(fn, max(rep_ms // rounds, 20)))
    return {name: statistics.median_high(values) for name, values in times.items()}


def check(inputs: dict, outputs, rows: int = 32) -> float:
    """||out - ref|| / ||ref|| on the first ``rows`` query rows (float64 reference)."""
    sub = {
        k: (v[:rows] if k in ("q", "indices", "topk_length") and v is not None else v)
        for k, v in inputs.items()
    }
    ref_out, _, _ = sparse_mla_prefill_reference(**sub, chunk_rows=8)
    return ((outputs[0][:rows].double() - ref_out).norm() / ref_out.norm()).item()


def sm90_visible() -> bool:
    """Whether the current GPU is an SM90 one (H100, H200): what the benchmarks time."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def section_args(doc: str, rep_ms: int, flag: str, flag_help: str, name: str) -> argparse.Namespace | None:
    """The command line of a benchmark section run alone (``python -m scripts.bench.<section>``, described by
    its ``doc``): a store-true ``flag`` and ``--rep`` (default ``rep_ms``). None, said on stderr, where no
    SM90 GPU is visible (``name``: the section, in that line)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(flag, action="store_true", help=flag_help)
    parser.add_argument("--rep", type=int, default=rep_ms, help="do_bench repetition time per arm, ms")
    args = parser.parse_args()
    if not sm90_visible():
        print(f"the {name} benchmark needs an SM90 GPU", file=sys.stderr)
        return None
    return args


def measured_rows(shapes, measure, line) -> list[dict]:
    """``measure(*shape)`` of each of ``shapes``, each row printed as ``line(shape, row)`` when measured, the
    CUDA caching allocator's free memory released after each; the rows."""
    rows = []
    for shape in shapes:
        row = measure(*shape)
        print(line(shape, row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows
