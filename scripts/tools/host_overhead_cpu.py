"""Host time of one call measured without a GPU: the host code that runs around the kernel.

CPU tensors stand in for CUDA ones. The device check runs for real on stand-in ``cuda:0`` devices (the
capability cached as (9, 0), as after the first call on an H100/H200), the kernel is a no-op function,
so the rows below are the package's own host time; on a GPU the kernel's TVM-FFI call adds its own.
A "memo miss" row is a call whose argument signature the contract has not seen (new shapes, new buffers):
the memo is emptied before each call. Thread CPU time, the best of several repeats, so that other load on
the machine counts least.

    python -m scripts.tools.host_overhead_cpu
"""

import os
import time
import types

os.environ.setdefault("Q8KV8_COMPILE_AT_IMPORT", "0")  # nothing here needs the compiled kernels
import torch

import q8kv8
from q8kv8 import contract, kernels

S_Q, H_Q, S_KV, D_QK, TOPK = 1, 64, 256, 576, 128


def per_call_us(fn, calls: int = 2000, repeats: int = 15) -> float:
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.thread_time() - start) / calls)
    return best * 1e6


class _EveryKey(dict):
    """A variant registry that hands out one fake variant whatever the key."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def get(self, key, default=None):
        return self.variant


def main() -> None:
    fp8 = torch.float8_e4m3fn
    inputs = {
        "q": torch.zeros(S_Q, H_Q, D_QK, dtype=fp8),
        "kv": torch.zeros(S_KV, 1, D_QK, dtype=fp8),
        "indices": torch.zeros(S_Q, 1, TOPK, dtype=torch.int32),
        "sm_scale": D_QK**-0.5,
        "q_scale": torch.ones(1),
        "kv_scale": torch.ones(1),
    }
    buffers = {
        "out": torch.empty(S_Q, H_Q, 512, dtype=torch.bfloat16),
        "max_logits": torch.empty(S_Q, H_Q),
        "lse": torch.empty(S_Q, H_Q),
    }
    check_args = (*inputs.values(), 512, None, None, *buffers.values(), "default")
    check_args_no_buffers = (*inputs.values(), 512, None, None, None, None, None, "default")
    prefill_call = getattr(q8kv8, "prefill_call", None)

    def checker(args):
        """A function that runs contract.check_inputs on ``args``: as one PrefillCall built here, or
        positional in an older checkout."""
        if prefill_call is None:
            return lambda: contract.check_inputs(*args)
        call = prefill_call.PrefillCall(*args)
        return lambda: contract.check_inputs(call)

    check_buffers, check_no_buffers = checker(check_args), checker(check_args_no_buffers)

    # The real device check, on stand-in CUDA devices of a cached SM90 capability.
    contract._capabilities[0] = (9, 0)
    real_check_device = contract.check_device
    cuda0 = torch.device("cuda:0")
    contract.check_device = lambda named: real_check_device(dict.fromkeys(named, cuda0))

    # The kernel: a no-op function in place of the compiled one; q8kv8.kernels' launch wrapper runs.
    torch.cuda.current_device = lambda: None  # CPU tensors have device index None (one GPU: never switch)
    variant = types.SimpleNamespace(function=lambda *args: None, name="no-op", d_qk=D_QK)
    kernels._variants = _EveryKey(variant)
    schedule = getattr(q8kv8, "schedule", None)
    if schedule is not None:
        schedule._sm_counts = _EveryKey(132)  # the multiprocessor count of a stand-in H100/H200
    launch_args = (
        inputs["q"], inputs["kv"], inputs["indices"], None, None, inputs["q_scale"], inputs["kv_scale"],
        inputs["sm_scale"], *buffers.values(), "default",
    )  # fmt: skip

    memo = getattr(contract, "_memo", {})
    # A paged call (V3.2 cache of 8 pages of 64 tokens, bf16 q), if this checkout has one.
    paged_fwd = getattr(q8kv8, "sparse_mla_q8kv8_paged_fwd", None)
    paged_inputs = {
        "q": torch.zeros(S_Q, H_Q, D_QK, dtype=torch.bfloat16),
        "cache": torch.zeros(8, 64, 1, 656, dtype=torch.uint8),
        "indices": inputs["indices"],
        "sm_scale": inputs["sm_scale"],
    }

    def memo_miss(check):
        memo.clear()
        check()

    rows = {
        "contract.check_inputs, buffers given": check_buffers,
        "contract.check_inputs, buffers given, memo miss": lambda: memo_miss(check_buffers),
        "contract.check_inputs, no buffers": check_no_buffers,
        "contract.check_inputs, no buffers, memo miss": lambda: memo_miss(check_no_buffers),
        "kernels.launch_sparse_prefill (no-op kernel)": lambda: kernels.launch_sparse_prefill(*launch_args),
        "full call, buffers given (no-op kernel)": lambda: q8kv8.sparse_mla_q8kv8_prefill_fwd(
            **inputs, **buffers
        ),
    }
    if paged_fwd is not None:
        rows["paged call, buffers given (no-op kernel)"] = lambda: paged_fwd(**paged_inputs, **buffers)
    for name, fn in rows.items():
        print(f"{name:48s} {per_call_us(fn):6.2f} us")

    # The C++ fast path (q8kv8.native), with a stand-in CPU device registered and a Python no-op as the
    # kernel: that callback costs TVM-FFI a Python call that a compiled kernel does not.
    native = getattr(q8kv8, "native", None)
    extension = native and native.load()
    if extension is not None:
        import tvm_ffi

        contract._memo.clear()
        no_op_python, variant.function = variant.function, tvm_ffi.convert(lambda *args: None)
        native.register_device(torch.device("cpu"), 132)  # planned for 132 SMs
        native.launch = extension.launch
        call = prefill_call.PrefillCall(*check_args)
        fast_rows = {
            "fast path alone (no-op kernel callback)": lambda: extension.launch(call),
            "full call, fast path, buffers given": lambda: q8kv8.sparse_mla_q8kv8_prefill_fwd(
                **inputs, **buffers
            ),
            "full call, fast path, allocating": lambda: q8kv8.sparse_mla_q8kv8_prefill_fwd(**inputs),
        }
        if paged_fwd is not None:
            fast_rows["paged call, fast path, buffers given"] = lambda: paged_fwd(**paged_inputs, **buffers)
            fast_rows["paged call, fast path, allocating"] = lambda: paged_fwd(**paged_inputs)
        for name, fn in fast_rows.items():
            print(f"{name:48s} {per_call_us(fn):6.2f} us")
        variant.function = no_op_python  # the layers' kernels: Python no-ops, which the fast path declines
        extension.configure(**native.constants())

    layer_rows(variant, extension)


def layer_rows(variant, extension) -> None:
    """One ``SparsePrefill`` call (V3.2 cache, 32k prefix, s_q 256, h 16, topk 2048) on each path, its
    kernels no-ops: Python ones (every call on the Python path), then, with ``extension``, TVM-FFI ones (its
    attention calls on the fast path, as on a GPU). Last: every tensor reports ``cuda:0`` from here on (the
    layer's and the gather's device checks pass) and ``torch.empty`` ignores the device."""
    from q8kv8 import paged, serving, workspace

    page, prefix, s_q, h = 64, 32768, 256, 16
    num_pages = prefix // page + 4
    inputs = {
        "q": torch.zeros(s_q, h, 576, dtype=torch.bfloat16),
        "cache": torch.zeros(num_pages, page, 1, 656, dtype=torch.uint8),
        "page_table": torch.randperm(num_pages * page)[:prefix].to(torch.int32),
        "indices": torch.zeros(s_q, 2048, dtype=torch.int32),
        "seqlens": torch.arange(prefix - s_q + 1, prefix + 1, dtype=torch.int32),
        "compress_ratio": 0,
        "sm_scale": 576**-0.5,
    }
    cuda0 = torch.device("cuda", 0)
    layers = {}
    for path in ("workspace", "paged"):
        layer = layers[path] = serving.SparsePrefill("fp8", path=path)
        layer.workspace = workspace.SparsePrefillWorkspace("cpu", 576)
        layer.workspace.reserve(prefix, torch.float8_e4m3fn)
        layer.workspace.device = cuda0
        layer._ones[cuda0] = torch.ones(1)
    paged._ones[cuda0] = torch.ones(1)
    real_empty = torch.empty
    torch.empty = lambda *args, device=None, **kwargs: real_empty(*args, **kwargs)
    torch.Tensor.device = property(lambda self: cuda0)
    torch.Tensor.is_cuda = property(lambda self: True)
    torch.cuda.device_count = lambda: 1
    for path, layer in layers.items():
        name = f"SparsePrefill, {path} path (no-op kernels)"
        print(f"{name:48s} {per_call_us(lambda layer=layer: layer.forward(**inputs), calls=500):6.2f} us")
    if extension is None:
        return
    import tvm_ffi

    from q8kv8 import native

    variant.function = tvm_ffi.convert(lambda *args: None)
    native.register_device(torch.device("cpu"), 132)
    native.launch = extension.launch
    for path, layer in layers.items():
        name = f"SparsePrefill, {path} path, fast path"
        print(f"{name:48s} {per_call_us(lambda layer=layer: layer.forward(**inputs), calls=500):6.2f} us")


if __name__ == "__main__":
    main()
