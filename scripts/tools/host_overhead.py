"""Where the host time of one call goes: the C++ fast path (q8kv8.native), or the contract checks, the
wrapper and the TVM-FFI launch of the Python path.

Times each stage in a loop of launches queued without syncs on a tiny problem (the GPU keeps up),
then prints a cProfile of the full call.

    python -m scripts.tools.host_overhead
"""

import cProfile
import pstats

import torch

import q8kv8
from q8kv8 import contract, eager, kernels, native
from q8kv8.prefill_call import PrefillCall
from scripts.bench.common import host_us, make_inputs


def per_call_us(fn) -> float:
    return host_us(fn, calls=3000, warmup=100)


def main() -> None:
    inputs = make_inputs(1, 256, 64, 576, 128, None, "cuda")
    out, max_logits, lse = q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs)
    buffers = {"out": out, "max_logits": max_logits, "lse": lse}
    call = PrefillCall(
        inputs["q"], inputs["kv"], inputs["indices"], inputs["sm_scale"], inputs["q_scale"],
        inputs["kv_scale"], 512, None, None, out, max_logits, lse, "default",
    )  # fmt: skip
    allocating_call = call._replace(out=None, max_logits=None, lse=None)
    extension = native.load()
    variant = kernels.load(kernels.VariantKey(576))
    no_tl, no_sink = kernels.placeholders(inputs["q_scale"], inputs["kv_scale"])
    ffi_args = (
        inputs["q"], inputs["kv"], inputs["indices"], no_tl, no_sink, inputs["q_scale"], inputs["kv_scale"],
        out, max_logits, lse, 1.0, 0, 1,
    )  # fmt: skip
    rows = {
        "contract.check_inputs": lambda: contract.check_inputs(call),
        "kernels.launch_sparse_prefill": lambda: kernels.launch_sparse_prefill(
            inputs["q"],
            inputs["kv"],
            inputs["indices"],
            None,
            None,
            inputs["q_scale"],
            inputs["kv_scale"],
            inputs["sm_scale"],
            out,
            max_logits,
            lse,
            "default",
        ),  # fmt: skip
        "TVM-FFI call alone": lambda: variant.function(*ffi_args),
        "fast path alone (C++ extension)": lambda: extension.launch(call),
        "fast path alone, allocating": lambda: extension.launch(allocating_call),
        "full call": lambda: q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs, **buffers),
        "full call, allocating": lambda: q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs),
        "the three output allocations alone": lambda: eager.output_buffers(inputs["q"], 64, 512),
    }
    assert native.launch is extension.launch, "the first call did not enable the fast path"
    for name, fn in rows.items():
        print(f"{name:40s} {per_call_us(fn):7.1f} us")
    native.launch = None  # every call takes the Python path
    for name in ("full call", "full call, allocating"):
        print(f"{name + ', Python path':40s} {per_call_us(rows[name]):7.1f} us")
    native.launch = extension.launch
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs, **buffers)
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
