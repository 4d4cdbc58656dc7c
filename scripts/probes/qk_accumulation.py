"""How exact are the QK logits? The kernel's max_logits and lse against a float64 reference on the same e4m3
inputs, next to cuBLAS FP8 GEMMs of the same dot products (``torch._scaled_mm``) with the tensor cores'
fast accumulation, with fp32 accumulation, and with fast accumulation promoted to fp32 every 128, 64 or 32
elements of d_qk (four, two or one FP8 WGMMA k-steps).

Large logits: q and kv ~ N(0, 1) in e4m3, d_qk 576, sm_scale 0.25 (raw dot products ~ +-24 per unit
variance, logits up to ~30). Needs an SM90 GPU:

    python -m scripts.probes.qk_accumulation
"""

import torch

from q8kv8 import sparse_mla_q8kv8_prefill_fwd
from q8kv8.reference import sparse_mla_prefill_reference

S_Q, H_Q, S_KV, D_QK, TOPK, SM_SCALE = 64, 64, 4096, 576, 2048, 0.25
E4M3 = torch.float8_e4m3fn


def relative(got: torch.Tensor, want: torch.Tensor) -> str:
    error = (got.double() - want) / want.abs().clamp_min(1e-30)
    return f"max |rel| {error.abs().max():.2e}, mean rel {error.mean():+.2e}"


def scaled_mm(a: torch.Tensor, b_t: torch.Tensor, fast: bool) -> torch.Tensor:
    one = torch.ones((), device=a.device)
    return torch._scaled_mm(a, b_t, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=fast)


def main() -> int:
    torch.manual_seed(0)
    q = torch.randn(S_Q, H_Q, D_QK, device="cuda").to(E4M3)
    kv = torch.randn(S_KV, 1, D_QK, device="cuda").to(E4M3)
    indices = torch.rand(S_Q, S_KV, device="cuda").topk(TOPK, dim=1).indices.to(torch.int32)[:, None]
    one = torch.ones(1, device="cuda")
    ref_out, ref_max, ref_lse = sparse_mla_prefill_reference(q, kv, indices, SM_SCALE, one, one, chunk_rows=8)
    print(f"logits: max {ref_max.max():.1f}, lse up to {ref_lse.max():.1f}")
    for precision in ("default", "accurate"):
        out, max_logits, lse = sparse_mla_q8kv8_prefill_fwd(
            q, kv, indices, SM_SCALE, one, one, precision=precision
        )
        lse_abs = (lse.double() - ref_lse).abs().max()
        print(
            f"kernel {precision:8s} max_logits {relative(max_logits, ref_max)}; "
            f"lse {relative(lse, ref_lse)}, max |abs| {lse_abs:.3f}"
        )

    # The same dot products through cuBLAS: rows of q against every kv row.
    a = q.reshape(-1, D_QK)[:2048].contiguous()
    b_t = kv[:, 0].t()  # [D_QK, S_KV], column-major
    exact = a.double() @ kv[:, 0].double().t()
    big = exact.abs() > exact.abs().quantile(0.99)  # the largest dot products, as max_logits sees them
    products = [("fast accumulation", scaled_mm(a, b_t, fast=True))]
    products.append(("fp32 accumulation", scaled_mm(a, b_t, fast=False)))
    for chunk in (128, 64, 32):  # fast accumulation, partial sums promoted to fp32 every `chunk` elements
        promoted = sum(
            scaled_mm(a[:, k : k + chunk].contiguous(), b_t[k : k + chunk], fast=True)
            for k in range(0, D_QK, chunk)
        )
        products.append((f"fast, promoted per {chunk}", promoted))
    for name, product in products:
        print(f"cuBLAS {name:24s} top 1% of |q.k|: {relative(product[big], exact[big])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
