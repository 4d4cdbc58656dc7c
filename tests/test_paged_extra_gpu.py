"""``sparse_mla_q8kv8_paged_fwd`` with an extra cache on an H100/H200 (``gpu`` marker): DeepSeek V4.1's main
cache with its FP4 extra cache gathered into V4.1 tokens, and V4's compressed and SWA caches (or two V4.1
caches), each pair read in one launch, in every schedule and with pages of other sizes in the extra cache, as
one softmax with a sink and per-part valid counts, against the float64 reference over both caches
(``sparse_mla_paged_reference(..., extra_cache=...)``); a CUDA graph replay.

Tolerances (``||out - ref|| / ||ref||``; max_logits and lse relative, absolute below 1), each part's own plus
the merge's (the parts' out rounded to bf16 before it: about 2^-9 relative):

- FP4 extra caches with power-of-two e4m3 scales (their rows gathered to e4m3 exactly): out within 4e-2
  (default) and 8e-3 (accurate: the paged V4.1 part's 5e-3 and the kernel on rows' 5e-3, with the merge's
  rounding), logits within 1e-2 (default: V4.1's S one chain, the tensor cores' sums) and 1e-3 (accurate);
- FP4 extra caches as the quantiser writes them (each value times its e4m3 scale rounded once to e4m3,
  about 2^-4 relative): the workspace way's bounds against the exact reference (``test_v41_gpu.py``), out
  within 8e-2 and logits within 0.15;
- V4 + V4: out within 4e-2 (default) and 1.5e-2 (accurate: V4's V has its RoPE dims as one e4m3 term),
  logits within 5e-3 and 1e-3 (``test_paged_gpu.py``).
"""

import pytest
import torch
from cuda_graphs import capture_and_replay
from paged_cache import pow2_fp4_scales, quantized_cache, to_device
from reference_checks import assert_outputs_match, logit_tolerances, out_tolerances

from q8kv8 import sparse_mla_q8kv8_paged_fwd
from q8kv8.eager import forced_splits, forced_tiles_per_cta
from q8kv8.reference import sparse_mla_paged_reference

pytestmark = pytest.mark.gpu

BF16, E4M3 = torch.bfloat16, torch.float8_e4m3fn
PAGE_SIZE = 64
OUT_TOLERANCE = {"v41_fp4": out_tolerances(4e-2, 8e-3), "model1": out_tolerances(4e-2, 1.5e-2)}
LOGIT_TOLERANCE = {"v41_fp4": logit_tolerances(1e-2, 1e-3), "model1": logit_tolerances(5e-3, 1e-3)}
ROUNDED_FP4_OUT_TOLERANCE, ROUNDED_FP4_LOGIT_TOLERANCE = 8e-2, 0.15


def make_call(
    generator,
    main,
    extra,
    s_q,
    h,
    *,
    topk=512,
    extra_topk=256,
    pow2_fp4=True,
    q_dtype=BF16,
    extra_page_size=None,
):
    """Keyword arguments of one call on the GPU: slots uniform over each cache and a few past either end,
    valid counts random but for a query with no valid slot, one with the extra part's only and one with the
    main part's only; a sink. The extra cache's pages hold ``extra_page_size`` tokens (by default the main
    cache's ``PAGE_SIZE``)."""
    pages, extra_pages = 24, 12
    extra_page_size = extra_page_size or PAGE_SIZE
    caches = []
    for layout, count, page_size in ((main, pages, PAGE_SIZE), (extra, extra_pages, extra_page_size)):
        cache = quantized_cache(layout, count, page_size, generator, pow2_scales=True)
        caches.append(pow2_fp4_scales(cache, generator) if layout == "v41_fp4" and pow2_fp4 else cache)
    indices = torch.randint(-2, pages * PAGE_SIZE + 2, (s_q, 1, topk), generator=generator, dtype=torch.int32)
    extra_indices = torch.randint(
        -2, extra_pages * extra_page_size + 2, (s_q, 1, extra_topk), generator=generator, dtype=torch.int32
    )
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    extra_topk_length = torch.randint(0, extra_topk + 1, (s_q,), generator=generator, dtype=torch.int32)
    topk_length[:2], extra_topk_length[0], extra_topk_length[2] = 0, 0, 0
    call = {
        "q": (torch.randn(s_q, h, 512, generator=generator)).to(q_dtype).cuda(),
        "cache": to_device(caches[0], "cuda"),
        "indices": indices.cuda(),
        "sm_scale": 512**-0.5,
        "q_scale": None,
        "attn_sink": torch.randn(h, generator=generator).cuda(),
        "topk_length": topk_length.cuda(),
        "extra_cache": to_device(caches[1], "cuda"),
        "extra_indices": extra_indices.cuda(),
        "extra_topk_length": extra_topk_length.cuda(),
    }
    if q_dtype == E4M3:
        call["q_scale"] = (0.5 + torch.rand(1, generator=generator)).cuda()
    return call


def run(call, **kwargs):
    outputs = sparse_mla_q8kv8_paged_fwd(**call, **kwargs)
    torch.cuda.synchronize()
    return outputs


def reference(call):
    return sparse_mla_paged_reference(**call, chunk_rows=16)


@pytest.mark.parametrize("precision", ["default", "accurate"])
@pytest.mark.parametrize("q_dtype", [BF16, E4M3], ids=["bf16q", "e4m3q"])
@pytest.mark.parametrize("h", [64, 16])
@pytest.mark.parametrize("main, extra", [("v41", "v41_fp4"), ("model1", "model1")])
def test_matches_the_float64_reference_over_both_caches(generator, main, extra, h, q_dtype, precision):
    call = make_call(generator, main, extra, 40, h, q_dtype=q_dtype)
    outputs = run(call, precision=precision)
    rel = assert_outputs_match(
        outputs, reference(call), OUT_TOLERANCE[extra][precision], LOGIT_TOLERANCE[extra][precision]
    )
    print(f"extra cache {main} + {extra} h {h} {q_dtype} {precision}: ||out - ref|| / ||ref|| = {rel:.2e}")


@pytest.mark.parametrize("precision", ["default", "accurate"])
def test_fp4_extra_as_the_quantiser_writes_it(generator, precision):
    call = make_call(generator, "v41", "v41_fp4", 40, 64, pow2_fp4=False)
    outputs = run(call, precision=precision)
    rel = assert_outputs_match(
        outputs, reference(call), ROUNDED_FP4_OUT_TOLERANCE, ROUNDED_FP4_LOGIT_TOLERANCE
    )
    print(f"extra cache v41 + rounded v41_fp4 {precision}: ||out - ref|| / ||ref|| = {rel:.2e}")


SCHEDULES = {
    "one tile": lambda: forced_tiles_per_cta(0),
    "persistent": lambda: forced_tiles_per_cta(2),
    "split": lambda: forced_splits(4),
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize(
    "main, extra_page_size, h", [("model1", 32, 128), ("v41", 128, 64), ("model1", 64, 16)]
)
def test_an_extra_cache_of_the_main_layout_in_every_schedule(generator, main, extra_page_size, h, schedule):
    """Read in the main launch (the index slots from the main top-k on are the extra cache's token slots),
    its pages of another size than the main cache's: one tile, persistent, split in 4 (small heads: their
    own kernel whatever is forced), both precisions."""
    call = make_call(generator, main, main, 24, h, extra_page_size=extra_page_size)
    bounds = "model1" if main == "model1" else "v41_fp4"  # V4.1's: those of its paged part
    for precision in ("default", "accurate"):
        with SCHEDULES[schedule]():
            outputs = run(call, precision=precision)
        assert_outputs_match(
            outputs, reference(call), OUT_TOLERANCE[bounds][precision], LOGIT_TOLERANCE[bounds][precision]
        )


def test_v41_extra_read_directly(generator):
    call = make_call(generator, "v41", "v41", 24, 64)
    assert_outputs_match(
        run(call), reference(call), OUT_TOLERANCE["v41_fp4"]["default"], LOGIT_TOLERANCE["v41_fp4"]["default"]
    )


@pytest.mark.parametrize("main, extra", [("v41", "v41_fp4"), ("model1", "model1")])
def test_cuda_graph_replay(generator, main, extra):
    """Captured with the caller's buffers after one eager call (the kernels built): the replay writes the
    eager call's outputs bit for bit."""
    call = make_call(generator, main, extra, 20, 64)
    eager = [t.clone() for t in run(call)]
    buffers = [torch.empty_like(t) for t in eager]
    named = dict(zip(("out", "max_logits", "lse"), buffers, strict=True))
    run(call, **named)  # warm-up outside capture
    capture_and_replay(lambda: sparse_mla_q8kv8_paged_fwd(**call, **named), buffers)
    assert all(torch.equal(got, want) for got, want in zip(buffers, eager, strict=True))
