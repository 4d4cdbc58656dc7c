"""The bf16 attention kernel builds for sm_90a without a GPU, uses bf16 WGMMA, TMA for Q and the
cp.async row gather, fits in registers and shared memory, and is cached on disk (CPU tests)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import cuda_tools
import pytest

from cute_kernels.sm90 import sparse_prefill_bf16
from q8kv8 import build, kernels

REPO = Path(__file__).resolve().parent.parent
D_QK = (512, 576)


@pytest.fixture(scope="module")
def variants():
    return {d_qk: kernels.load(kernels.Bf16AttentionKey(d_qk)) for d_qk in D_QK}


def test_both_variants_build(variants):
    assert sorted(variants) == list(D_QK)
    for d_qk, variant in variants.items():
        assert variant.name == f"sparse_prefill_bf16_sm90_d{d_qk}"
        assert variant.object_path.exists() and variant.ptx_path.exists()


@pytest.mark.parametrize("d_qk", D_QK)
def test_ptx_uses_bf16_wgmma_tma_and_cp_async(variants, d_qk):
    ptx = variants[d_qk].ptx_path.read_text()
    wgmma = re.findall(r"wgmma\.mma_async\.\S+", ptx)
    assert set(wgmma) == {
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16",  # S = Q.K^T
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16",  # O += P.V
    }
    assert wgmma.count("wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16") == d_qk // 16
    assert wgmma.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == 4
    # PV reads V MN-major (transpose-B flag 1), QK reads K K-major (0).
    pv = re.findall(r"m64n256k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+, p, 1,\s*1, 0, (\d);", ptx)
    qk = re.findall(r"m64n32k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+, p, 1,\s*1, 0, (\d);", ptx)
    assert pv == ["1"] * 4 and qk == ["0"] * (d_qk // 16)
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == d_qk // 64  # the Q tile, by TMA
    # Gather: two rows per lane, one 128-byte column tile per instruction.
    assert len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint", ptx)) == 2 * d_qk // 64
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{sparse_prefill_bf16.PRODUCER_REGS};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{sparse_prefill_bf16.CONSUMER_REGS};", ptx)
    assert "cvt.rn.bf16x2.f32" in ptx  # P and out rounded to bf16


@pytest.mark.parametrize("d_qk", D_QK)
def test_ptxas_reports_no_spills_and_no_wgmma_serialisation(variants, d_qk):
    report = build.ptxas_report(variants[d_qk])
    if report is None:
        pytest.skip(cuda_tools.missing("ptxas"))
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report.text
    assert "serialized" not in report.text, report.text
    assert not re.search(r"C75(0\d|1\d|20)", report.text), report.text
    assert report.stack_frame_bytes == 0, report.text
    assert report.registers <= 168, report.text  # 65536 / 384 threads


def test_register_split_fits_the_register_file():
    regs = sparse_prefill_bf16.PRODUCER_REGS + 2 * sparse_prefill_bf16.CONSUMER_REGS
    assert regs * sparse_prefill_bf16.THREADS_PER_WG <= 65536


@pytest.mark.parametrize("d_qk, slots", [(512, 4), (576, 3)])
def test_shared_memory_budget(d_qk, slots):
    kernel = sparse_prefill_bf16.SparsePrefillBf16Sm90(d_qk)
    assert kernel.num_slots == slots
    expected = 3072 + 64 * d_qk * 2 + slots * 32 * d_qk * 2 + 2 * 64 * 64 * 2
    assert (
        kernel.shared_memory_bytes()
        == kernels.shared_memory_bytes(kernels.Bf16AttentionKey(d_qk))
        == expected
    )
    assert expected <= sparse_prefill_bf16.MAX_SMEM_BYTES


def test_rejects_other_head_dims():
    with pytest.raises(ValueError, match="d_qk must be 512 or 576"):
        sparse_prefill_bf16.SparsePrefillBf16Sm90(128)
    with pytest.raises(ValueError, match="d_qk: expected one of"):
        kernels.load(kernels.Bf16AttentionKey(128))


def test_bf16_variants_are_lazy_and_disk_cached(tmp_path):
    code = (
        "import q8kv8.kernels as k, q8kv8; keys = [k.Bf16AttentionKey(d) for d in (512, 576)];"
        "assert not any(key in k._variants for key in keys); s = k.cache_stats; before = (s.hits, s.misses);"
        "k.load_variants(keys); print(s.hits - before[0], s.misses - before[1])"
    )
    env = dict(os.environ, Q8KV8_CACHE_DIR=str(tmp_path))

    def run():
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
        )
        return tuple(int(x) for x in result.stdout.split())

    assert run() == (0, 2)
    assert run() == (2, 0)
