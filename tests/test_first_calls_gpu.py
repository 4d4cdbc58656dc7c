"""First calls from several threads at once on an H100/H200 (``gpu`` marker): in a fresh process (builds
deferred to the first call: ``Q8KV8_COMPILE_AT_IMPORT=0``), threads make their first calls of different kernel
variants together, with the disk cache warm or empty; every call succeeds, and each gives the bits that the
same call gives afterwards, made alone."""

import os
import textwrap

import pytest
import torch
from fresh_process import run_python

pytestmark = pytest.mark.gpu

FIRST_CALLS = textwrap.dedent(
    """
    import sys
    import torch
    from fresh_process import run_at_once
    from q8kv8 import sparse_mla_q8kv8_prefill_fwd

    BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
    generator = torch.Generator().manual_seed(int(sys.argv[1]))
    # (q dtype, s_q, h_q, topk, precision, topk_length): the small-head, split, one-tile, persistent and
    # bf16-q variants
    CASES = [
        (BF16, 20, 16, 512, "default", False),
        (E4M3, 16, 64, 2048, "default", False),
        (E4M3, 40, 32, 512, "accurate", False),
        (E4M3, 300, 128, 1024, "default", False),
        (BF16, 1100, 128, 256, "accurate", True),
    ][: int(sys.argv[2])]

    def inputs(q_dtype, s_q, h_q, topk, precision, with_topk_length):
        s_kv = 5000
        q = torch.randn(s_q, h_q, 576, generator=generator).to(q_dtype)
        kv = torch.randn(s_kv, 1, 576, generator=generator).to(E4M3)
        indices = torch.randint(-1, s_kv, (s_q, 1, topk), generator=generator, dtype=torch.int32)
        topk_length = torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
        args = dict(
            q=q.cuda(),
            kv=kv.cuda(),
            indices=indices.cuda(),
            sm_scale=0.05,
            q_scale=None if q_dtype == BF16 else torch.ones(1, device="cuda"),
            kv_scale=torch.full((1,), 0.5, device="cuda"),
            topk_length=topk_length.cuda() if with_topk_length else None,
            precision=precision,
        )
        return args

    def first_call(call):
        outputs = sparse_mla_q8kv8_prefill_fwd(**call)
        torch.cuda.synchronize()
        return outputs

    calls = [inputs(*case) for case in CASES]
    first = run_at_once([lambda call=call: first_call(call) for call in calls])
    for i, call in enumerate(calls):
        again = sparse_mla_q8kv8_prefill_fwd(**call)
        for name, a, b in zip(("out", "max_logits", "lse"), first[i], again):
            assert torch.equal(a.view(torch.int16 if a.dtype == BF16 else torch.int32),
                               b.view(torch.int16 if b.dtype == BF16 else torch.int32)), (i, name)
        assert torch.isfinite(again[0]).all(), i
    print("ok", len(calls))
    """
)


@pytest.mark.parametrize("cache", ["warm", "empty"])
def test_first_calls_from_threads(tmp_path, generator, cache):
    """Five threads, five variants, the cache warm (loads only); two threads with an empty cache (each
    variant built on its first call, one at a time)."""
    env = dict(os.environ, Q8KV8_COMPILE_AT_IMPORT="0")
    threads = 5
    if cache == "empty":
        env["Q8KV8_CACHE_DIR"] = str(tmp_path)
        threads = 2
    seed = int(torch.randint(2**31, (1,), generator=generator))
    result = run_python(FIRST_CALLS, str(seed), str(threads), env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["ok", str(threads)], result.stdout
