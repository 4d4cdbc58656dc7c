"""``make bench``'s precisions: each ``precision``'s time relative to the default's on the main table's shapes
(timed in the main table's interleaved rounds), and its errors against the float64 reference: ``out``
(``||out - ref|| / ||ref||``), ``max_logits`` and ``lse`` (the worst row's relative error, signed: the FP8
tensor cores' own sums read low) on the benchmark's rows and on rows led by one slot at a logit of 20-30
(each query a multiple of one of its selected kv rows, plus noise), where the logits' accumulation shows.

    python -m scripts.bench.precisions   # the errors alone
"""

from __future__ import annotations

import sys

import torch

from q8kv8 import sparse_mla_q8kv8_prefill_fwd
from q8kv8.metadata import PRECISIONS
from q8kv8.reference import sparse_mla_prefill_reference
from scripts.bench.common import make_inputs, quantize, sm90_visible

ERROR_SHAPES = [(576, 2048), (512, 512)]  # d_qk, topk: h_q 64, 64 query rows over 32k kv rows
ERROR_ROWS, ERROR_HEADS, ERROR_S_KV = 64, 64, 32768


def print_times(results: list[dict]) -> None:
    """The main table's rows (``scripts.bench.__main__``): each precision's time over the default's."""
    others = [precision for precision in PRECISIONS if precision != "default"]
    print("\nprecisions (timed with the table above): time / default's")
    print(f"{'shape':30s} {'default ms':>10s} | " + " | ".join(f"{p:>15s}" for p in others))
    for row in results:
        ms = row["q8kv8"]["ms"]
        ratios = [row[f"q8kv8_{p}"]["ms"] / ms for p in others]
        row["precision_ratios"] = dict(zip(others, ratios, strict=True))
        print(f"{row['shape']:30s} {ms:10.3f} | " + " | ".join(f"{x:15.2f}" for x in ratios), flush=True)


def dominant_rows(inputs: dict, generator: torch.Generator) -> dict:
    """``inputs`` with each query row replaced by noise plus a multiple of the dequantised kv row of its
    first slot, so that its largest logit is 20-30 (a new e4m3 q and q_scale)."""
    kv = inputs["kv"][:, 0].float() * inputs["kv_scale"]
    first = kv[inputs["indices"][:, 0, 0].long()]  # [s_q, d_qk]
    s_q, h_q, _ = inputs["q"].shape
    target = 20.0 + 10.0 * torch.rand(s_q, h_q, 1, generator=generator).cuda()
    multiple = target / (first.square().sum(-1)[:, None, None] * inputs["sm_scale"])
    q = 0.3 * torch.randn(inputs["q"].shape, generator=generator).cuda() + multiple * first[:, None, :]
    q, q_scale = quantize(q)
    return {**inputs, "q": q, "q_scale": q_scale}


def errors(inputs: dict, precision: str, reference) -> dict:
    got = sparse_mla_q8kv8_prefill_fwd(**inputs, precision=precision)
    out = ((got[0].double() - reference[0]).norm() / reference[0].norm()).item()
    signed = []
    for got_stat, want in zip(got[1:], reference[1:], strict=True):
        relative = (got_stat.double() - want) / want.abs().clamp_min(1.0)
        signed.append(relative.view(-1)[relative.abs().argmax()].item())
    return {"out": out, "max_logits": signed[0], "lse": signed[1]}


def error_rows() -> list[dict]:
    print(
        f"\nprecisions against float64 (h_q {ERROR_HEADS}, {ERROR_ROWS} query rows over {ERROR_S_KV} kv "
        "rows): out rel err; max_logits / lse: worst row's relative error, signed"
    )
    print(
        f"{'d_qk':>4s} {'topk':>5s} {'rows':>9s} {'precision':>15s} | {'out':>8s} | {'max_logits':>10s} | "
        f"{'lse':>10s}"
    )
    generator = torch.Generator().manual_seed(2)
    rows = []
    for d_qk, topk in ERROR_SHAPES:
        plain = make_inputs(ERROR_ROWS, ERROR_S_KV, ERROR_HEADS, d_qk, topk, None, "cuda")
        for kind, inputs in (("benchmark", plain), ("dominant", dominant_rows(plain, generator))):
            reference = sparse_mla_prefill_reference(**inputs, chunk_rows=8)
            for precision in PRECISIONS:
                row = {"d_qk": d_qk, "topk": topk, "rows": kind, "precision": precision}
                row |= errors(inputs, precision, reference)
                rows.append(row)
                print(
                    f"{d_qk:4d} {topk:5d} {kind:>9s} {precision:>15s} | {row['out']:8.2e} | "
                    f"{row['max_logits']:+10.2e} | {row['lse']:+10.2e}",
                    flush=True,
                )
    return rows


def main() -> int:
    if not sm90_visible():
        print("the precisions' errors are measured on an SM90 GPU; none is visible here", file=sys.stderr)
        return 2
    error_rows()
    return 0


if __name__ == "__main__":
    sys.exit(main())
