"""The kernel variants build for sm_90a without a GPU, use the instructions they are meant to use, fit
in registers, and are cached on disk (CPU tests, run in CI)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import cuda_tools
import pytest
from variant_subset import cases

from cute_kernels.interface import PRECISIONS, SPLIT_PARTS
from cute_kernels.sm90 import fp8_tile, paged_rows, qk_products, sparse_prefill, split_merge
from cute_kernels.sm90.cta import B_H
from q8kv8 import build, disk_cache, kernels
from q8kv8.schedule import ONE_TILE, PERSISTENT, SPLIT
from scripts.tools import ptx_manifest, sass_counts

REPO = Path(__file__).resolve().parent.parent


def key(d_qk, precision="default", kind=ONE_TILE, q_dtype=kernels.FP8, heads=64, cache=None):
    return kernels.VariantKey(d_qk, precision, kind, q_dtype, heads, cache)


def variant(*options, **named):
    """The variant of those options (``key``'s), built or loaded."""
    return kernels.load(key(*options, **named))


@pytest.fixture(scope="module")
def variants():
    """The one-tile variants for an e4m3 q, by (d_qk, precision)."""
    return {(d_qk, precision): variant(d_qk, precision) for d_qk, precision in VARIANT_KEYS}


def persistent_variants():
    return {(d_qk, precision): variant(d_qk, precision, PERSISTENT) for d_qk, precision in PERSISTENT_KEYS}


VARIANT_KEYS = [(d_qk, precision) for d_qk in (512, 576) for precision in kernels.IMPORT_PRECISIONS]
PERSISTENT_KEYS = VARIANT_KEYS
SINGLE_PURCHASES = [precision for precision in PRECISIONS if precision not in kernels.IMPORT_PRECISIONS]
"""The precisions that buy one of the accurate mode's two parts (built on first use): their one-tile
variants are checked as the others, and one variant of each other kind (d_qk 576) for its registers."""
ONE_TILE_KEYS = VARIANT_KEYS + [(d_qk, precision) for d_qk in (512, 576) for precision in SINGLE_PURCHASES]


def p_terms(precision) -> int:
    """The e4m3 terms P is stored as."""
    return PRECISIONS[precision].p_terms


def promoted(precision) -> bool:
    """Whether S is summed in float32 (``qk_promoted``)."""
    return PRECISIONS[precision].qk_in_float32


def test_import_builds_every_variant(variants):
    assert sorted(variants) == sorted(VARIANT_KEYS)
    for (d_qk, precision), variant in variants.items():
        assert variant.name == kernels.VariantKey(d_qk, precision).name
        assert variant.object_path.exists() and variant.ptx_path.exists()
    for (d_qk, precision), persistent in persistent_variants().items():
        suffix = "_accurate" if precision == "accurate" else ""
        assert persistent.name == f"sparse_prefill_sm90_d{d_qk}{suffix}_persistent"
        assert persistent.object_path.exists() and persistent.ptx_path.exists()
    assert len(kernels.load_variants()) == len(VARIANT_KEYS) + len(PERSISTENT_KEYS)


@pytest.mark.variants
@pytest.mark.parametrize(
    "d_qk, precision", cases(PERSISTENT_KEYS, lambda d, p: [key(d, p), key(d, p, PERSISTENT)])
)
def test_persistent_ptx_has_the_one_tile_kernels_instructions(variants, d_qk, precision):
    """The persistent variant runs the same WGMMAs, Q TMA and row copies (in a loop over tiles)."""
    one_tile = variants[d_qk, precision].ptx_path.read_text()
    persistent = variant(d_qk, precision, PERSISTENT).ptx_path.read_text()
    assert_same_math_instructions(persistent, one_tile)


MATH_INSTRUCTIONS = (
    r"wgmma\.mma_async\.\S+",
    r"cp\.async\.bulk\.tensor",
    r"cp\.async\.cg\.shared",
    r"ldmatrix",
)
"""The WGMMAs, the Q tile's TMA, the row copies and the V^T fragment loads, as PTX patterns."""


def assert_same_math_instructions(ptx: str, one_tile_ptx: str) -> None:
    for pattern in MATH_INSTRUCTIONS:
        assert len(re.findall(pattern, ptx)) == len(re.findall(pattern, one_tile_ptx)), pattern


def promoted_qk_wgmmas(d_qk: int) -> int:
    """The WGMMA instructions of S (or of one N = 32 half) summed in float32 (``qk_promoted``): its first
    group, the loop's group, and the last, shorter group when the group size does not divide d_qk / 32."""
    group = qk_products.QK_PROMOTION_KSTEPS
    return 2 * group + d_qk // 32 % group


@pytest.mark.variants
@pytest.mark.parametrize("d_qk, precision", cases(ONE_TILE_KEYS, lambda d, p: [key(d, p)]))
def test_ptx_uses_fp8_wgmma_tma_and_cp_async(d_qk, precision):
    ptx = variant(d_qk, precision).ptx_path.read_text()
    wgmma = re.findall(r"wgmma\.mma_async\.\S+", ptx)
    n64, n32 = (f"wgmma.mma_async.sync.aligned.m64n{n}k32.f32.e4m3.e4m3" for n in (64, 32))
    # k-steps of O^T (4 d tiles x 2 k-steps per block, once per e4m3 term of P) on the three PV paths: two
    # blocks (the common one), the other's block only, own only
    pv_steps = (16 + 8 + 8) * p_terms(precision)
    if promoted(precision):  # S in two N = 32 halves
        assert set(wgmma) == {n64, n32}
        assert wgmma.count(n32) == 2 * promoted_qk_wgmmas(d_qk) and wgmma.count(n64) == pv_steps
    else:  # S = Q.K^T as one group of d_qk / 32 k-steps
        assert set(wgmma) == {n64} and len(wgmma) == d_qk // 32 + pv_steps
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == d_qk // 64  # the Q tile, by TMA
    assert len(re.findall(r"cp\.async\.cg\.shared\.global\.L2::cache_hint", ptx)) == d_qk // 64 * 4
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    assert re.search(rf"setmaxnreg\.dec\.sync\.aligned\.u32\s+{sparse_prefill.PRODUCER_REGS};", ptx)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{sparse_prefill.CONSUMER_REGS};", ptx)
    # P of two terms: f32 exponentials rounded to f16 (cvt.rn.f16x2.f32), split into hi = e4m3(p) and
    # lo = e4m3(p - hi) (cvt.rn.f16x2.e4m3x2 takes hi back to f16); 16 per copy of the softmax. No
    # f16x2 exponentials in any precision.
    two_terms = p_terms(precision) == 2
    for pattern in (r"cvt\.rn\.f16x2\.f32", r"cvt\.rn\.f16x2\.e4m3x2"):
        count = len(re.findall(pattern, ptx))
        assert (count > 0 and count % 16 == 0) if two_terms else count == 0, (pattern, count)
    assert "ex2.approx.f16x2" not in ptx


@pytest.mark.variants
@pytest.mark.parametrize(
    "d_qk, precision, persistent",
    cases(
        [(d_qk, precision, persistent) for persistent in (False, True) for d_qk, precision in ONE_TILE_KEYS],
        lambda d, p, persistent: [key(d, p, PERSISTENT if persistent else ONE_TILE)],
    ),
)
def test_ptxas_reports_no_spills_and_no_wgmma_serialisation(d_qk, precision, persistent):
    if persistent and (d_qk, precision) not in PERSISTENT_KEYS and d_qk != 576:
        pytest.skip("checked at d_qk 576")
    assert_fits_in_registers(variant(d_qk, precision, PERSISTENT if persistent else ONE_TILE))


def assert_fits_in_registers(variant):
    """``ptxas -v`` on the variant's PTX: no spills, no stack frame, no serialised WGMMA, at most 168
    registers per thread (65536 / 384 threads)."""
    report = build.ptxas_report(variant)
    if report is None:
        pytest.skip(cuda_tools.missing("ptxas"))
    assert report.spill_store_bytes == 0 and report.spill_load_bytes == 0, report.text
    assert "wgmma.mma_async instructions are serialized" not in report.text, report.text
    assert report.stack_frame_bytes == 0, report.text
    assert report.registers <= 168, report.text


SPLIT_AND_BF16_Q_KEYS = [
    (d_qk, precision, q_dtype)
    for q_dtype in (kernels.FP8, kernels.BF16_Q)
    for d_qk, precision in VARIANT_KEYS + [(576, p) for p in SINGLE_PURCHASES]
]


def split_and_bf16_q_keys(d_qk, precision, q_dtype):
    kinds = (SPLIT, ONE_TILE, PERSISTENT) if q_dtype == kernels.BF16_Q else (SPLIT,)
    return [key(d_qk, precision, kind, q_dtype) for kind in kinds]


@pytest.mark.variants
@pytest.mark.parametrize(
    "d_qk, precision, q_dtype",
    cases(
        SPLIT_AND_BF16_Q_KEYS,
        split_and_bf16_q_keys,
        ids=[f"{d}-{p}-{kernels.KERNEL_Q_DTYPES[q]}" for d, p, q in SPLIT_AND_BF16_Q_KEYS],
    ),
)
def test_split_and_bf16_q_variants_fit_in_registers(d_qk, precision, q_dtype):
    """The variants built on first use (split, for either q dtype; one-tile and persistent for a bfloat16 q)
    fit as the others do (a single purchase: its split variant for an e4m3 q)."""
    if precision in SINGLE_PURCHASES and q_dtype == kernels.BF16_Q:
        pytest.skip("checked for an e4m3 q")
    assert_fits_in_registers(variant(d_qk, precision, SPLIT, q_dtype))
    if q_dtype == kernels.BF16_Q:
        for kind in (ONE_TILE, PERSISTENT):
            assert_fits_in_registers(variant(d_qk, precision, kind, q_dtype))


@pytest.mark.variants
@pytest.mark.parametrize(
    "d_qk, precision",
    cases(
        VARIANT_KEYS,
        lambda d, p: [
            *(key(d, p, kind, kernels.BF16_Q) for kind in (ONE_TILE, PERSISTENT, SPLIT)),
            key(d, p, PERSISTENT, kernels.BF16_Q, 16),
        ],
    ),
)
def test_bf16_q_rows_are_staged_by_bulk_copies(d_qk, precision):
    """With a bfloat16 q the 64-head variants (one-tile, persistent, split) stage a tile's rows in shared
    memory by bulk copies (one per block tile when its 32 rows lie in q, else one per producer thread: half a
    row) and quantise them from there, with no global loads of q; the small-head variants' consumers load
    their rows from global memory (two 16-byte loads per 64-column tile)."""
    bulk = r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
    for ptx in (
        variant(d_qk, precision, ONE_TILE, kernels.BF16_Q).ptx_path.read_text(),
        variant(d_qk, precision, PERSISTENT, kernels.BF16_Q).ptx_path.read_text(),
        variant(d_qk, precision, SPLIT, kernels.BF16_Q).ptx_path.read_text(),
    ):
        assert len(re.findall(bulk, ptx)) == 2
        assert "ld.global.nc.v4" not in ptx
        assert len(re.findall(r"ld\.shared\.v4\.b32", ptx)) == 2 * (d_qk // 64)
    small = variant(d_qk, precision, PERSISTENT, kernels.BF16_Q, 16).ptx_path.read_text()
    assert not re.search(bulk, small)
    assert len(re.findall(r"ld\.global\.nc\.v4\.b32", small)) == 2 * (d_qk // 64)


@pytest.mark.variants
@pytest.mark.parametrize("d_qk, precision", cases(VARIANT_KEYS, lambda d, p: [key(d, p), key(d, p, SPLIT)]))
def test_split_ptx_runs_the_one_tile_math_and_merges_in_the_cluster(variants, d_qk, precision):
    """The split variant runs the one-tile kernel's WGMMAs, Q TMA and row copies; its parts exchange their
    results through the cluster's shared memory (``st.async`` counted on the receiver's mbarrier, after a
    release-arrival that its KV tiles are free: the O^T fragments as pairs of f16x2 words, the row statistics
    as float32 pairs) and it writes bf16 out, no float32 partial results; and the split tail's overlap."""
    one_tile = variants[d_qk, precision].ptx_path.read_text()
    split = variant(d_qk, precision, SPLIT).ptx_path.read_text()
    assert_same_math_instructions(split, one_tile)
    st_async = r"st\.async\.shared::cluster\.mbarrier::complete_tx::bytes\.(\w+\.\w+)"
    exchanged = set(re.findall(st_async, split))
    assert exchanged == {"v2.b32", "v2.f32"}, exchanged
    assert "mbarrier.arrive.release.cluster.shared::cluster.b64" in split
    assert "barrier.cluster.wait" in split
    assert "st.global.v2.f32" not in split and "cvt.rn.bf16x2.f32" in split
    # A split tail's launches overlap: the one-tile kernel lets its dependent start, the split one waits for
    # it before it ends (both only under the split-tail flag).
    assert "griddepcontrol.launch_dependents" in one_tile and "griddepcontrol.wait" not in one_tile
    assert "griddepcontrol.wait" in split and "griddepcontrol.launch_dependents" not in split


@pytest.mark.parametrize("splits", SPLIT_PARTS)
def test_split_merge_slots_are_distinct_and_fit_in_the_kv_tiles(splits):
    """The split merge's layout in a part's KV tiles: every d tile of O^T has one owner; the fragments an
    owner receives (from every other part, and with 8 parts its own too) take distinct slots, exactly
    ``fragments_received`` of them; the statistics and the weights after them fit in the smallest KV tiles."""
    tiles_per_consumer = fp8_tile.D_TILES_PER_CONSUMER
    owners = {
        (c, mt): split_merge.d_tile_owner(splits, mt, c) for c in (0, 1) for mt in range(tiles_per_consumer)
    }
    assert sorted(owners.values()) == sorted(p for p in range(splits) for _ in range(8 // splits))
    received = {owner: [] for owner in range(splits)}
    for sender in range(splits):
        for (c, mt), owner in owners.items():
            if splits > tiles_per_consumer or owner != sender:
                received[owner].append(split_merge.fragment_slot(splits, sender, owner, c, mt))
    count = split_merge.fragments_received(splits)
    for slots in received.values():
        assert sorted(slots) == list(range(count)), slots
    assert count * split_merge.FRAGMENT_BYTES <= split_merge.SPLIT_STATS_OFFSET
    end = split_merge.SPLIT_WEIGHTS_OFFSET + B_H * split_merge.SPLIT_WEIGHTS_ROW_BYTES
    assert end <= fp8_tile.NUM_KV_TILES * fp8_tile.B_TOPK * 512  # d_qk 512's KV tiles


SMALL_HEAD_KEYS = [
    (d_qk, precision, heads, q_dtype)
    for d_qk, precision in VARIANT_KEYS
    for heads in (8, 16, 32)
    for q_dtype in (kernels.FP8, kernels.BF16_Q)
] + [(576, precision, 16, kernels.FP8) for precision in SINGLE_PURCHASES]


@pytest.mark.variants
@pytest.mark.parametrize(
    "d_qk, precision, heads, q_dtype",
    cases(
        SMALL_HEAD_KEYS,
        lambda d, p, h, q: [key(d, p, PERSISTENT, q, h)],
        ids=[f"{d}-{p}-h{h}-{kernels.KERNEL_Q_DTYPES[q]}" for d, p, h, q in SMALL_HEAD_KEYS],
    ),
)
def test_small_head_variants_fit_and_compute_the_transposed_products(d_qk, precision, heads, q_dtype):
    """The small-head variants fit as the others do; their QK product is an m64nNk32 WGMMA with the heads on
    N (d_qk / 32 k-steps, or in groups summed in float32), their PV product the one-tile kernel's O^T
    with N = heads (4 d tiles x 8 k-steps: a pair of blocks, the other consumer's alone, the own alone, per P
    term), and P^T is stored in whole 32-bit words (two lanes' slots of one head, joined by a shuffle), no
    16-bit stores."""
    small = variant(d_qk, precision, PERSISTENT, q_dtype, heads)
    assert_fits_in_registers(small)
    ptx = small.ptx_path.read_text()
    wgmmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", ptx)
    assert set(wgmmas) == {str(heads)}, set(wgmmas)
    qk_steps = promoted_qk_wgmmas(d_qk) if promoted(precision) else d_qk // 32
    assert len(wgmmas) == qk_steps + 4 * 8 * p_terms(precision)
    assert "st.shared.b32" in ptx and "st.shared.b16" not in ptx


PAGED_KEYS = [
    (layout, precision, kind, q_dtype, heads)
    for layout in ("v32", "model1", "v41")
    for precision in kernels.IMPORT_PRECISIONS
    for kind, heads in (
        (ONE_TILE, 64),
        (PERSISTENT, 64),
        (SPLIT, 64),
        (PERSISTENT, 8),
        (PERSISTENT, 16),
        (PERSISTENT, 32),
    )
    for q_dtype in (kernels.FP8, kernels.BF16_Q)
] + [
    (layout, precision, kind, kernels.FP8, heads)
    for layout in ("v32", "model1", "v41")
    for precision in SINGLE_PURCHASES
    for kind, heads in ((ONE_TILE, 64), (PERSISTENT, 16))
]
PAGED_D_QK = {"v32": 576, "model1": 512, "v41": 512}
PAGED_SPILL_BYTES = 40
"""The paged variants' consumers at their register ceiling (240, or 232 beside a producer of
``sparse_prefill.WIDE_PRODUCER_REGS``): 64 heads summing S per scale group on the persistent schedule (the
PV products' V factors beside the tile state; 4-16 B with an e4m3 q), and with an e4m3 q on the split one (a
value kept from the prologue to the epilogue), and the
small-head kernel with an e4m3 q (8, 16 or 32 heads, by layout and precision: a value kept from the prologue
to each tile's epilogue, and a few bytes the producer spills and reloads once a pass of its gather loop),
spill at most this much (measured 4-36 B); every other paged variant fits (the small-head ones with a bf16 q
beside a producer of ``sparse_prefill.WIDE_PRODUCER_REGS``)."""


def rows_rescaled(layout) -> bool:
    """Whether the paged variant rescales each block row to one power-of-two scale before its QK product
    (``convert_row``): V4 and V4.1, whose UE8M0 scales are powers of two."""
    return layout in ("v41", "model1")


def paged_spills(layout, precision, kind, q_dtype, heads) -> bool:
    if heads != 64:
        return q_dtype == kernels.FP8
    if rows_rescaled(layout):
        return False
    return kind == PERSISTENT or (kind == SPLIT and q_dtype == kernels.FP8)


@pytest.mark.variants
@pytest.mark.parametrize(
    "layout, precision, kind, q_dtype, heads",
    cases(PAGED_KEYS, lambda layout, p, kind, q, h: [key(PAGED_D_QK[layout], p, kind, q, h, layout)]),
)
def test_paged_variants_gather_pages_and_sum_scale_groups(layout, precision, kind, q_dtype, heads):
    """The paged kernel (``paged_rows``): S from WGMMA groups of a scale group's k-steps (S promoted: at most
    ``PAGED_ACCURATE_CHUNK_KSTEPS``: the first group and the loop's, and the RoPE's 2 k-steps x 2 e4m3
    terms; 64 heads: once per N = 32 half; small heads: S^T = K . Q^T whole, N = heads), or with its rows
    rescaled (V4, V4.1) one chain over every k-step and a bf16 RoPE's lo terms at N = 64 (small heads: S^T;
    S promoted: ``qk_promoted``'s groups, the lo terms in the first; E of a row the largest of its scale
    bytes, a byte maximum); PV as the kernel on gathered rows; per
    row, four 16-byte copies per 64-byte column of its e4m3 values and bf16 RoPE (no L2 cache hint) and four
    4-byte copies of its scales; the Q TMA for an e4m3 q; registers as the others, within the documented
    spills."""
    small = "" if heads == 64 else f"_h{heads}"
    built = variant(PAGED_D_QK[layout], precision, kind, q_dtype, heads, cache=layout)
    assert built.name.startswith(f"sparse_prefill_sm90_d{PAGED_D_QK[layout]}{small}_paged_{layout}")
    ptx = built.ptx_path.read_text()
    geometry = paged_rows.cache_geometry(layout)
    chunk = geometry.group_ksteps
    if promoted(precision):
        chunk = min(chunk, qk_products.PAGED_ACCURATE_CHUNK_KSTEPS)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3", ptx)
    pv = (16 + 8 + 8) * p_terms(precision)  # a pair of blocks and a single one, per d tile
    rope_lo = 2 if geometry.rope_column is not None else 0  # a bf16 RoPE's lo terms
    assert ("max.u16x2" in ptx) == rows_rescaled(layout)  # E from the largest scale byte (scale_record)
    if rows_rescaled(layout) and promoted(precision):
        # qk_promoted, its first group (a bf16 RoPE's lo terms too) and its loop's (64 heads: per N = 32 half)
        halves = 2 if heads == 64 else 1
        per_half = 2 * qk_products.ROW_SCALED_PROMOTION_KSTEPS + rope_lo
        qk = [str(32 if heads == 64 else heads)] * (halves * per_half)
        assert sorted(wgmma) == sorted(qk + [str(heads)] * pv)
    elif rows_rescaled(layout):
        assert wgmma == [str(heads)] * (PAGED_D_QK[layout] // 32 + rope_lo + pv)
    elif heads == 64:
        assert wgmma.count("32") == 2 * (2 * chunk + 4) and wgmma.count("64") == pv
    else:
        assert set(wgmma) == {str(heads)} and len(wgmma) == 2 * chunk + 4 + pv
    assert len(re.findall(r"cp\.async\.cg\.shared\.global", ptx)) == 4 * (geometry.nope_columns + rope_lo)
    assert not re.search(r"cp\.async\.cg\.shared\.global\.L2::cache_hint", ptx)
    assert len(re.findall(r"cp\.async\.ca\.shared\.global", ptx)) == 4
    q_tma = 0 if q_dtype == kernels.BF16_Q else PAGED_D_QK[layout] // 64
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == q_tma
    report = build.ptxas_report(built)
    if report is None:
        pytest.skip(cuda_tools.missing("ptxas"))
    if paged_spills(layout, precision, kind, q_dtype, heads):
        assert report.spill_store_bytes <= PAGED_SPILL_BYTES and report.spill_load_bytes <= PAGED_SPILL_BYTES
        assert "wgmma.mma_async instructions are serialized" not in report.text and report.registers <= 168
    else:
        assert_fits_in_registers(built)


def _import_in_subprocess(cache: Path) -> dict:
    code = (
        "import q8kv8.kernels as k, q8kv8;"
        "print(k.cache_stats.hits, k.cache_stats.misses, k.cache_stats.rebuilt_corrupt,"
        " max(v.seconds for v in k._variants.values()))"
    )
    env = dict(os.environ, Q8KV8_CACHE_DIR=str(cache), Q8KV8_COMPILE_AT_IMPORT="1")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=True
    )
    hits, misses, rebuilt, seconds = result.stdout.split()
    announcements = [line for line in result.stderr.splitlines() if line.startswith("q8kv8: building")]
    return {
        "hits": int(hits),
        "misses": int(misses),
        "rebuilt": int(rebuilt),
        "seconds": float(seconds),
        "announcements": announcements,
    }


def test_second_import_hits_the_disk_cache_and_damage_is_rebuilt(tmp_path):
    first = _import_in_subprocess(tmp_path)
    count = len(VARIANT_KEYS) + len(PERSISTENT_KEYS)
    assert (first["hits"], first["misses"]) == (0, count)
    assert len(first["announcements"]) == 1 and str(tmp_path) in first["announcements"][0]  # one line
    second = _import_in_subprocess(tmp_path)
    assert (second["hits"], second["misses"]) == (count, 0)
    assert second["announcements"] == []  # loading is silent
    assert second["seconds"] < 1.0, "loading a cached variant should take well under a second"

    objects = sorted(tmp_path.rglob("*.o"))
    assert len(objects) == count
    objects[0].write_bytes(objects[0].read_bytes()[:1000])  # truncate one cached object
    third = _import_in_subprocess(tmp_path)
    assert (third["hits"], third["misses"], third["rebuilt"]) == (count - 1, 1, 1)
    assert (tmp_path / objects[0].relative_to(tmp_path)).stat().st_size > 1000


def test_a_build_says_so_in_one_line_and_a_load_says_nothing(tmp_path, monkeypatch, capfd):
    """A variant built (here the query cast, a few seconds) prints on stderr, after the process's one-time
    announcement, one line naming it and its seconds; loading it from the cache prints nothing."""
    monkeypatch.setenv("Q8KV8_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(disk_cache, "_announced", False)
    monkeypatch.setattr(kernels, "_variants", {})
    monkeypatch.setattr(kernels, "cache_stats", build.CacheStats())
    capfd.readouterr()
    assert kernels.load(kernels.QCastKey(512)).source == "compiled"
    announcement, built = capfd.readouterr().err.splitlines()
    assert announcement.startswith("q8kv8: building ") and f" into {tmp_path} (" in announcement
    assert re.fullmatch(r"q8kv8: built cast_q_fp8_sm90_d512 \(\d+\.\d s\)", built), built
    kernels._variants.clear()
    assert kernels.load(kernels.QCastKey(512)).source == "cache"
    assert capfd.readouterr().err == ""


def uniform_registers_read_unwritten(sass: str) -> set[str]:
    """The uniform registers that a row copy (``LDGSTS``) reads and no earlier instruction (in address
    order) writes. The copies' registers are set before the gather loops, so a register in this set is
    read uninitialised: ptxas has emitted ``LDGSTS [R + UR0], desc[UR1]`` with nothing writing UR0 or UR1,
    an illegal instruction at run time."""
    written, unwritten = set(), set()
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s+([^;]*);", sass):
        opcode, operands = match.groups()
        registers = re.findall(r"\bUR(\d+)\b", operands)
        if opcode.startswith("LDGSTS"):
            unwritten.update(f"UR{r}" for r in registers if f"UR{r}" not in written)
            continue
        destination = re.findall(r"\bUR(\d+)\b", operands.split(",")[0])
        width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
        written.update(f"UR{int(r) + i}" for r in destination for i in range(width))
    return unwritten


def _gather_variants():
    """Every attention variant with a row gather: the FP8 kernel's (every schedule, q dtype, head count and
    cache layout) and the bf16 kernel's."""
    attention = (kernels.VariantKey, kernels.Bf16AttentionKey)
    return [
        variant for variant in kernels.listed_variants() if isinstance(kernels.key_of(variant), attention)
    ]


@pytest.mark.variants
def test_row_copies_read_only_uniform_registers_they_set(tmp_path, listing):
    """The SASS of every variant with a row gather (ptxas on its PTX, nvdisasm): each ``LDGSTS`` reads only
    uniform registers an earlier instruction writes (see ``cute_kernels.sm90.row_gather.copy_rows``)."""
    ptxas, disassembler = shutil.which("ptxas"), sass_counts.disassembler()
    if ptxas is None or disassembler is None:
        pytest.skip(
            cuda_tools.missing(
                *(name for name, path in (("ptxas", ptxas), ("nvdisasm", disassembler)) if path is None)
            )
        )
    failures = {}
    for variant in _gather_variants():
        sass = sass_counts.sass(variant.ptx_path, tmp_path)
        assert "LDGSTS" in sass, variant.name
        unwritten = uniform_registers_read_unwritten(sass)
        if unwritten:
            failures[variant.name] = sorted(unwritten)
    assert not failures, failures


@pytest.mark.variants
def test_ptx_matches_the_manifest(listing):
    """Each listed variant's PTX (the representative ones in ``make test``, every one in ``make
    test-variants``) is byte for byte the PTX ``tests/ptx_manifest.json`` records: a change that only moves
    code keeps it; a change meant to change kernels rewrites the manifest (``python -m
    scripts.tools.ptx_manifest``) and names in its commit the variants that changed. Skipped under a CuTe DSL
    version other than the manifest's."""
    manifest = ptx_manifest.read_manifest()
    if manifest["dsl"] != ptx_manifest.dsl_version():
        pytest.skip(f"the manifest records the PTX of CuTe DSL {manifest['dsl']}")
    built = ptx_manifest.ptx_hashes(kernels.listed_variants())
    assert {key.name for key in listing} == set(built)  # every listed variant keeps its PTX
    recorded = {name: digest for name, digest in manifest["variants"].items() if name in built}
    lines = ptx_manifest.differences(recorded, built)
    assert not lines, "\n".join(lines + ["(python -m scripts.tools.ptx_manifest rewrites the manifest)"])
