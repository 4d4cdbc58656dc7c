"""Which reading of a paged cache's block scales keeps the logits? A float64 emulation (CPU, no GPU) of the
paged kernel's arithmetic with its e4m3 roundings (the tensor cores' accumulation is exact here), against
float64 on the exactly dequantised cache:

- ``groups``: S summed per scale group with the exact scales, the RoPE as two e4m3 terms at a power-of-two
  scale of its own, V's fragments times their f16 scale rounded to e4m3 (the paged kernel's V3.2 path and
  its accurate mode);
- ``groups, V by rows``: S as ``groups``; after it each row's V rescaled to one power-of-two scale 2^E (its
  groups' bytes times sigma_g 2^-E rounded to e4m3; V4: with its RoPE's hi term), P carrying 2^E as in
  ``rows``;
- ``rows``: each row rescaled to one power-of-two scale 2^E (every group's bytes times sigma_g 2^-E rounded
  to e4m3, the RoPE's two terms at 2^-E), S = 2^E (Q . K''^T), P = e4m3(2^7 exp2(x - m) 2^E) with m the max of
  x + E, V'' used as it is (the paged kernel's V4 path in the default precision);
- ``workspace``: the rows gathered into an e4m3 workspace with scale 1.0 (nope and RoPE each rounded once to
  e4m3), then the kernel on gathered rows.

Caches: ``pow2`` scales (FlashMLA's V3.2 test quantiser, V4's UE8M0) and ``float`` scales (max|x| / 448: the
V3.2 quantisers of vLLM and SGLang). Rows: ``unit`` (kv ~ N(0, 0.5), q ~ N(0, 1), sm_scale d_qk^-0.5),
``small`` (kv ~ N(0, 2^-9): values under e4m3's normal range once dequantised), ``groups apart`` (a row's
scale groups 2^-3 .. 2^2 apart) and ``dominant`` (one slot per query at a logit of 20-30). Default
precision (P one e4m3 term). q is quantised per row as the kernel does it; the reference uses the same q.

    python -m scripts.probes.paged_scales
"""

import math

import torch

from cute_kernels.sm90.paged_rows import ROW_MAX_EXPONENT, ROW_MIN_EXPONENT

E4M3 = torch.float8_e4m3fn
LAYOUTS = {"v32": (512, 128), "model1": (448, 64)}  # (nope dims, scale group)
ROPE = 64
D_V = 512
LOG2_E = 1.0 / math.log(2.0)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(E4M3).double()


def least_exponent(amax: torch.Tensor) -> torch.Tensor:
    """The least e with amax <= 448 2^e (at least -126; -126 for zero)."""
    e = torch.ceil(torch.log2(amax.clamp_min(1e-300) / 448))
    return e.clamp_min(-126)


def make_cache(layout: str, scales: str, rows: str, n: int, q: torch.Tensor, gen: torch.Generator):
    """``(bytes [n, groups, group], sigma [n, groups], rope [n, 64])``: kv quantised per scale group."""
    d_nope, group = LAYOUTS[layout]
    kv = torch.randn(n, d_nope + ROPE, generator=gen, dtype=torch.float64) * (
        2.0**-9 if rows == "small" else 0.5
    )
    if rows == "groups apart":
        apart = torch.randint(-3, 3, (n, d_nope // group), generator=gen).double().exp2()
        kv[:, :d_nope] *= apart.repeat_interleave(group, 1)
    if rows == "dominant":  # slot i is query i's: a logit of 20-30 at sm_scale d_qk^-0.5
        h = q.shape[0]
        target = 20 + 10 * torch.rand(h, generator=gen, dtype=torch.float64)
        kv[:h] = q * (target * math.sqrt(q.shape[1]) / (q * q).sum(1))[:, None]
    tiles = kv[:, :d_nope].reshape(n, -1, group)
    sigma = tiles.abs().amax(-1).clamp_min(1e-4) / 448
    if scales == "pow2":
        sigma = torch.exp2(torch.ceil(torch.log2(sigma)))
    return e4m3(tiles / sigma[..., None]), sigma, kv[:, d_nope:].to(torch.bfloat16).double()


def attend(q, k, v, sm_scale, shift=None, rounded=True):
    """out, lse, max_logits of the default mode: P = e4m3(2^7 exp2(x - m) 2^shift), m the max of x + shift,
    row sums on x (``shift``: per slot, P carries 2^shift and ``v`` is V / 2^shift; ``rounded`` False: P
    exact, the reference)."""
    x = q @ k.T * (sm_scale * LOG2_E)
    shift = torch.zeros(k.shape[0], dtype=torch.float64) if shift is None else shift
    m = (x + shift).amax(-1, keepdim=True)
    p = torch.exp2(x - m)
    weights = p * torch.exp2(shift + 7)
    out = ((e4m3(weights) if rounded else weights) @ v) / (p.sum(-1, keepdim=True) * 2**7)
    lse = (m.squeeze(-1) + torch.log2(p.sum(-1))) / LOG2_E
    return out, lse, x.amax(-1) / LOG2_E


def two_terms(x: torch.Tensor) -> torch.Tensor:
    hi = e4m3(x)
    return hi + e4m3(x - hi)


def readings(bytes_, sigma, rope, q, sm_scale):
    """{reading: (out, lse, max_logits)}; V is a row's first 512 values (V4: its RoPE's last 64, hi alone)."""
    n = bytes_.shape[0]
    nope = (bytes_ * sigma[..., None]).reshape(n, -1)
    v_rope = D_V - nope.shape[1]  # V4: 64
    exact_k = torch.cat([nope, rope], 1)
    results = {"reference": attend(q, exact_k, exact_k[:, :D_V], sm_scale, rounded=False)}
    # groups: S exact per group, the RoPE's two terms at its own scale, V times an f16 scale, to e4m3
    rope_scale = torch.exp2(least_exponent(rope.abs().amax(1)))[:, None]
    rope_hi = e4m3(rope / rope_scale)
    k = torch.cat([nope, two_terms(rope / rope_scale) * rope_scale], 1)
    v_nope = e4m3(bytes_ * sigma.to(torch.float16).double()[..., None]).reshape(n, -1)
    results["groups"] = attend(q, k, torch.cat([v_nope, (rope_hi * rope_scale)[:, :v_rope]], 1), sm_scale)
    # groups, V by rows: the same S; V rescaled after it to one power-of-two scale 2^E per row (V4: with the
    # RoPE's hi term), P carrying 2^E
    exponent = torch.ceil(torch.log2(sigma)).amax(1)
    if v_rope:
        exponent = torch.maximum(exponent, torch.log2(rope_scale[:, 0]))
    exponent = exponent.clamp(ROW_MIN_EXPONENT, ROW_MAX_EXPONENT)
    row_scale = torch.exp2(exponent)[:, None]
    v_nope = e4m3(bytes_ * (sigma / row_scale).to(torch.float16).double()[..., None]).reshape(n, -1)
    v = torch.cat([v_nope, e4m3(rope_hi * (rope_scale / row_scale))[:, :v_rope]], 1)
    results["groups, V by rows"] = attend(q, k, v, sm_scale, exponent)
    # rows: one power-of-two scale 2^E per row for K and V
    exponent = torch.maximum(torch.ceil(torch.log2(sigma)).amax(1), least_exponent(rope.abs().amax(1)))
    exponent = exponent.clamp(ROW_MIN_EXPONENT, ROW_MAX_EXPONENT)
    row_scale = torch.exp2(exponent)[:, None]
    v_nope = e4m3(bytes_ * (sigma / row_scale).to(torch.float16).double()[..., None]).reshape(n, -1)
    k = torch.cat([v_nope, two_terms(rope / row_scale)], 1)
    v = torch.cat([v_nope, e4m3(rope / row_scale)[:, :v_rope]], 1)
    results["rows"] = attend(q, k * row_scale, v, sm_scale, exponent)
    # workspace: every value rounded once to e4m3 at scale 1.0
    k = e4m3(exact_k)
    results["workspace"] = attend(q, k, k[:, :D_V], sm_scale)
    return results


def errors(got, want) -> tuple[float, float, float]:
    out = ((got[0] - want[0]).norm() / want[0].norm()).item()
    lse = ((got[1] - want[1]) / want[1].abs().clamp_min(1)).abs().max().item()
    max_logits = ((got[2] - want[2]) / want[2].abs().clamp_min(1)).abs().max().item()
    return out, lse, max_logits


def run(layout: str, scales: str, rows: str, seed: int = 0, h: int = 64, topk: int = 2048) -> dict:
    """{reading: (out, lse, max_logits) errors} of one case."""
    gen = torch.Generator().manual_seed(seed)
    d_qk = LAYOUTS[layout][0] + ROPE
    q = torch.randn(h, d_qk, generator=gen, dtype=torch.float64)
    q_scale = torch.exp2(least_exponent(q.abs().amax(1)))[:, None]
    q = e4m3(q / q_scale) * q_scale
    results = readings(*make_cache(layout, scales, rows, topk, q, gen), q, d_qk**-0.5)
    reference = results.pop("reference")
    return {name: errors(got, reference) for name, got in results.items()}


def main() -> None:
    print("out: ||out - ref|| / ||ref||; lse, max_logits: max |error| / max(1, |ref|); 64 heads, topk 2048")
    for layout, scales in (("v32", "pow2"), ("v32", "float"), ("model1", "pow2")):
        for rows in ("unit", "small", "groups apart", "dominant"):
            cells = [
                f"{name} {o:.1e} / {lse:.1e} / {m:.1e}"
                for name, (o, lse, m) in run(layout, scales, rows).items()
            ]
            print(f"{layout:6s} {scales:5s} {rows:12s} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
