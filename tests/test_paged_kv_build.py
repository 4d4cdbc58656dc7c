"""The paged KV gather and query-cast kernels build for sm_90a without a GPU, use the instructions they
are meant to use (16-byte loads and stores, explicit rounding), fit in registers, are cached on disk,
and the gather reads the same layout as the PyTorch side (CPU tests)."""

import os
import subprocess
import sys
from pathlib import Path

import cuda_tools
import pytest
import torch

from cute_kernels.sm90 import paged_kv
from q8kv8 import build, kernels, kv_layout

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ("model1", "v32", "v41", "v41_fp4")
VARIANTS = [(layout, out_bf16) for layout in LAYOUTS for out_bf16 in (False, True)]
RECORDS_KEY = kernels.PagedGatherKey("v41_fp4", torch.uint8)  # V4.1 tokens from a V4.1 FP4 cache
GATHER_VARIANTS = len(VARIANTS) + 1  # the serving path's gathers: rows of each layout, and the records


@pytest.fixture(scope="module")
def variants():
    return {
        (layout, out_bf16): kernels.load(
            kernels.PagedGatherKey(layout, torch.bfloat16 if out_bf16 else torch.float8_e4m3fn)
        )
        for layout, out_bf16 in VARIANTS
    }


def test_kernel_layout_table_matches_kv_layout():
    for name, kernel_layout in paged_kv.LAYOUTS.items():
        layout = kv_layout.LAYOUTS[name]
        assert (kernel_layout.d_nope, kernel_layout.d_rope, kernel_layout.scale_group) == (
            layout.d_nope,
            layout.d_rope,
            layout.scale_group,
        )
        assert (kernel_layout.token_bytes, kernel_layout.rope_offset) == (
            layout.token_bytes,
            layout.rope_offset,
        )
        assert (kernel_layout.value_bits, kernel_layout.scale_type) == (layout.value_bits, layout.scale_type)
        if layout.scale_offset is None:
            assert kernel_layout.scale_offset == -1
            assert kernel_layout.scale_record_bytes == layout.bytes_per_token - layout.token_bytes
        else:
            assert kernel_layout.scale_offset == layout.scale_offset
    assert sorted(paged_kv.LAYOUTS) == sorted(kv_layout.LAYOUTS) == sorted(LAYOUTS)


def test_every_variant_builds(variants):
    assert sorted(variants) == sorted(VARIANTS)
    for (layout, out_bf16), variant in variants.items():
        assert variant.name == f"paged_kv_gather_sm90_{layout}_{'bf16' if out_bf16 else 'e4m3'}"
        assert variant.object_path.exists() and variant.ptx_path.exists()


@pytest.mark.parametrize(("layout", "out_bf16"), VARIANTS)
def test_ptx_uses_wide_accesses_and_explicit_rounding(variants, layout, out_bf16):
    ptx = variants[(layout, out_bf16)].ptx_path.read_text()
    out_bytes = 2 if out_bf16 else 1
    row_threads = kv_layout.LAYOUTS[layout].d_qk * out_bytes // 16  # one 16-byte chunk each
    assert f".reqntid {row_threads}, {8 // out_bytes}, 1" in ptx  # 256 or 288 threads: whole warps
    assert "st.global.v4.b32" in ptx
    assert "cvt.rn.f16x2.e4m3x2" in ptx and "mul.rn.f32" in ptx
    assert "fma" not in ptx and ".ftz" not in ptx  # no contraction, no flush-to-zero
    # the values' loads: 16 bytes (e4m3 out) or 8 (bf16 out) of e4m3, half as many of e2m1
    loads = ("v2.b32", "b32") if layout == "v41_fp4" else ("v4.b32", "v2.b32")
    assert f"ld.global.nc.{loads[out_bf16]}" in ptx
    if layout in ("model1", "v32"):
        assert "ld.global.nc.v4.b32" in ptx  # the RoPE's bf16 values
    if out_bf16:
        assert "cvt.rn.bf16x2.f32" in ptx and "e4m3x2.f32" not in ptx
    else:
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "bf16x2" not in ptx
    if layout in ("model1", "v41"):
        assert "ld.global.nc.u8" in ptx and "0x7fc00000" in ptx  # UE8M0 scales, byte 255 -> NaN
    elif layout == "v41_fp4":
        assert "ld.global.nc.u8" in ptx and "prmt.b32" in ptx  # e4m3 scales; e2m1 widened by a permute
    else:
        assert "ld.global.nc.b32" in ptx  # the float32 scale


def test_fp4_records_variant_uses_a_warp_a_row_and_explicit_rounding():
    """The V4.1 records from an FP4 cache: a warp a row (32 chunks of 16 values), the pair's scales shared by
    a shuffle, the scale words stored 4 bytes at a time, each value rounded once to e4m3, no contraction or
    flush-to-zero, and no spills."""
    variant = kernels.load(RECORDS_KEY)
    assert variant.name == "paged_kv_gather_sm90_v41_fp4_v41"
    ptx = variant.ptx_path.read_text()
    assert ".reqntid 32, 8, 1" in ptx
    assert "shfl.sync.bfly.b32" in ptx and "shfl.sync.idx.b32" in ptx
    assert "st.global.v4.b32" in ptx and "st.global.b32" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "mul.rn.f32" in ptx and "prmt.b32" in ptx
    assert "fma" not in ptx and ".ftz" not in ptx
    report = build.ptxas_report(variant)
    if report is None:
        pytest.skip(cuda_tools.missing("ptxas"))
    assert report.spill_store_bytes == report.spill_load_bytes == report.stack_frame_bytes == 0, report.text


@pytest.mark.parametrize(("layout", "out_bf16"), VARIANTS)
def test_ptxas_reports_no_spills(variants, layout, out_bf16):
    report = build.ptxas_report(variants[(layout, out_bf16)])
    if report is None:
        pytest.skip(cuda_tools.missing("ptxas"))
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report.text
    assert report.stack_frame_bytes == 0, report.text
    assert report.registers <= 64, report.text


def test_second_load_hits_the_disk_cache(tmp_path):
    code = (
        "import q8kv8.kernels as k; keys = [x for x in k.SERVING_KEYS if isinstance(x, k.PagedGatherKey)];"
        "vs = k.load_variants(keys); s = k.cache_stats; print(s.hits, s.misses, max(v.seconds for v in vs))"
    )
    env = dict(os.environ, Q8KV8_CACHE_DIR=str(tmp_path), Q8KV8_COMPILE_AT_IMPORT="0")

    def run():
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
        )
        hits, misses, seconds = result.stdout.split()
        return int(hits), int(misses), float(seconds)

    assert run()[:2] == (0, GATHER_VARIANTS)
    hits, misses, seconds = run()
    assert (hits, misses) == (GATHER_VARIANTS, 0) and seconds < 1.0
    assert len(list(tmp_path.rglob("paged_kv_gather_*.o"))) == GATHER_VARIANTS


@pytest.mark.parametrize("d", [512, 576])
def test_q_cast_kernel_builds_without_spills(d):
    variant = kernels.load(kernels.QCastKey(d))
    ptx = variant.ptx_path.read_text()
    assert f".reqntid {d // 16}, 8, 1" in ptx
    assert "div.rn.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx and ".ftz" not in ptx
    assert ptx.count("ld.global.nc.v4.b32") == 2 and ptx.count("st.global.v4.b32") == 2  # data, zeros
    report = build.ptxas_report(variant)
    if report is None:
        pytest.skip(cuda_tools.missing("ptxas"))
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0 and report.stack_frame_bytes == 0
