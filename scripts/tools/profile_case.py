"""Launch the kernel on one benchmark shape a few times, for ``ncu`` or ``compute-sanitizer``.

    ncu --clock-control none -k regex:kernel_cutlass --launch-skip 2 --launch-count 1 \\
        python -m scripts.tools.profile_case h128_kv64k_d576_tk2048 --s-q 1024
"""

import argparse

import torch

import q8kv8
from scripts.bench.common import SHAPES, make_inputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shape", help="a shape name from scripts/bench/common.py")
    parser.add_argument("--s-q", type=int, default=0, help="override s_q (0: the shape's own)")
    parser.add_argument("--launches", type=int, default=3)
    args = parser.parse_args()
    name, s_q, s_kv, h_q, d_qk, topk, tl_mode = next(s for s in SHAPES if s[0] == args.shape)
    inputs = make_inputs(args.s_q or s_q, s_kv, h_q, d_qk, topk, tl_mode, "cuda")
    for _ in range(args.launches):
        q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs)
    torch.cuda.synchronize()
    print(f"{name}: {args.launches} launches done")


if __name__ == "__main__":
    main()
