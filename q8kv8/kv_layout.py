"""The DeepSeek paged KV cache layouts q8kv8 reads: byte offsets, no torch, no DSL.

A paged cache is ``num_pages`` pages, ``page_stride`` bytes apart; token slot ``s`` lives in page
``s // page_size`` at position ``pos = s % page_size``. Offsets below are bytes from the page start.

MODEL1 (DeepSeek V4; FlashMLA ``FP8KVCacheLayout.MODEL1_FP8Sparse``), d_qk 512:
  - ``pos * 576 + [0, 448)``: 448 e4m3 "nope" values;
  - ``pos * 576 + [448, 576)``: 64 bf16 RoPE values (not quantised);
  - ``page_size * 576 + pos * 8 + [0, 7)``: 7 UE8M0 scales (float8_e8m0fnu, value 2^(byte - 127);
    byte 255 is NaN), scale t for nope values [64 t, 64 t + 64); byte 7 is padding;
  - the page is padded to a multiple of 576 bytes (``padded_page_bytes``); the cache is usually
    exposed as ``[num_pages, page_size, 1, 584]`` with page stride ``padded_page_bytes``.
V3.2 (DeepSeek V3.2; FlashMLA ``V32_FP8Sparse``), d_qk 576, 656 bytes per token at ``pos * 656``:
  - ``[0, 512)``: 512 e4m3 nope values;
  - ``[512, 528)``: 4 float32 scales, scale t for nope values [128 t, 128 t + 128);
  - ``[528, 656)``: 64 bf16 RoPE values.
  The cache is exposed as ``[num_pages, page_size, 1, 656]`` (page stride ``page_size * 656``).
V4.1 ("v41", DeepSeek V4.1's main cache), d_qk 512, 528 bytes per token at ``pos * 528``:
  - ``[0, 512)``: 512 e4m3 values covering all 512 dims (the 64 RoPE dims, 448 to 511, quantised too);
  - ``[512, 528)``: 16 UE8M0 scales (float8_e8m0fnu), scale t for values [32 t, 32 t + 32).
  Scales sit inside each token's record; pages are not padded (page stride ``page_size * 528``).
V4.1 FP4 ("v41_fp4", the extra cache next to a V4.1 main cache), d_qk 512, 288 bytes per token at
``pos * 288``:
  - ``[0, 256)``: 512 e2m1 values, two a byte, value 2 i in the low nibble of byte i, 2 i + 1 in the high;
  - ``[256, 288)``: 32 e4m3 scales, scale t for values [16 t, 16 t + 16).
  Pages are not padded (page stride ``page_size * 288``).
``PAGED_ATTENTION_LAYOUTS`` are the ones ``sparse_mla_q8kv8_paged_fwd`` reads directly (V3.2, V4, V4.1); the
gather (``q8kv8.paged_gather``) reads every layout, the V4.1 FP4 one included.

Sources: FlashMLA ``tests/quant.py`` (``quantize_k_cache`` / ``dequantize_k_cache``), FlashMLA
``flash_mla/flash_mla_interface.py`` (the 656-byte V3.2 format), FlashMLA
``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` (MODEL1 addressing: data at ``pos * (448 + 128)``,
scales at ``page_size * 576 + pos * 8``), SGLang ``nsa/dequant_k_cache.py`` (V3.2, ``view(-1, 656)``)
and SGLang's DeepSeek V4 ``dequant_k_cache.py`` (the same MODEL1 page layout). The V4.1 layouts follow
the description of FlashMLA's DeepSeek V4.1 formats (528 and 288 bytes a token as above); the FlashMLA
sources this package was checked against (up to its release of 2026-04-29) do not define them.
"""

from typing import NamedTuple


class KvCacheLayout(NamedTuple):
    """Per-token byte layout of one paged FP8 KV cache format."""

    name: str
    d_nope: int  # values stored with a block scale (V4.1: all of d_qk, the RoPE dims included)
    d_rope: int  # bf16 values, not quantised (V4.1: none)
    scale_group: int  # nope values per scale
    scale_bytes: int  # 1 (UE8M0 or e4m3) or 4 (float32)
    token_bytes: int  # bytes between consecutive tokens' nope+rope data (MODEL1) or records (the others)
    rope_offset: int  # RoPE offset inside a token's data (V4.1: the end of its values)
    scale_offset: int | None  # scales inside a token's record; None: in the page's scale region (MODEL1)
    bytes_per_token: int  # the last dim of the [num_pages, page_size, 1, bytes_per_token] view
    value_bits: int  # 8: e4m3 values; 4: e2m1 values, two a byte (low nibble first)
    scale_type: str  # "float32", "ue8m0" (float8_e8m0fnu) or "e4m3" (float8_e4m3fn)

    @property
    def d_qk(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def num_scales(self) -> int:
        return self.d_nope // self.scale_group

    @property
    def value_bytes(self) -> int:
        """Bytes of a token's block-scaled values."""
        return self.d_nope * self.value_bits // 8

    def min_page_bytes(self, page_size: int) -> int:
        """Bytes a page must hold: ``page_size`` tokens' data and scales (without padding)."""
        return page_size * self.bytes_per_token

    def padded_page_bytes(self, page_size: int) -> int:
        """The page size the producers allocate (MODEL1 pads each page to a multiple of 576 B)."""
        if self.scale_offset is not None:
            return self.min_page_bytes(page_size)
        return -(-self.min_page_bytes(page_size) // MODEL1_PAGE_ALIGN) * MODEL1_PAGE_ALIGN

    def scale_region_offset(self, page_size: int) -> int:
        """MODEL1: where the page's per-token scale records start (``page_size * 576``)."""
        return page_size * self.token_bytes


MODEL1_SCALE_RECORD_BYTES = 8  # 7 UE8M0 scales + 1 pad byte per token
MODEL1_PAGE_ALIGN = 576
_SCALE_BYTES = {"float32": 4, "ue8m0": 1, "e4m3": 1}


def _layout(
    name: str,
    d_nope: int,
    d_rope: int,
    scale_group: int,
    scale_type: str,
    value_bits: int = 8,
    *,
    page_scales: bool = False,
) -> KvCacheLayout:
    """A layout from its values and scales: a token's data is its block-scaled values, then its bf16 RoPE
    values, the scales in the page's scale region, ``MODEL1_SCALE_RECORD_BYTES`` a token (``page_scales``:
    MODEL1); or else a record of the values, their scales, then the RoPE values (with none, ``rope_offset``
    is the end of the values)."""
    values = d_nope * value_bits // 8
    scale_bytes = _SCALE_BYTES[scale_type]
    if page_scales:
        token_bytes = values + 2 * d_rope
        rope_offset, scale_offset = values, None
        bytes_per_token = token_bytes + MODEL1_SCALE_RECORD_BYTES
    else:
        scales = d_nope // scale_group * scale_bytes
        token_bytes = bytes_per_token = values + scales + 2 * d_rope
        rope_offset = values + scales if d_rope else values
        scale_offset = values
    return KvCacheLayout(
        name=name,
        d_nope=d_nope,
        d_rope=d_rope,
        scale_group=scale_group,
        scale_bytes=scale_bytes,
        token_bytes=token_bytes,
        rope_offset=rope_offset,
        scale_offset=scale_offset,
        bytes_per_token=bytes_per_token,
        value_bits=value_bits,
        scale_type=scale_type,
    )


MODEL1 = _layout("model1", d_nope=448, d_rope=64, scale_group=64, scale_type="ue8m0", page_scales=True)
V32 = _layout("v32", d_nope=512, d_rope=64, scale_group=128, scale_type="float32")
V41 = _layout("v41", d_nope=512, d_rope=0, scale_group=32, scale_type="ue8m0")
V41_FP4 = _layout("v41_fp4", d_nope=512, d_rope=0, scale_group=16, scale_type="e4m3", value_bits=4)

ALL_LAYOUTS = (MODEL1, V32, V41, V41_FP4)
PAGED_ATTENTION_LAYOUTS = (MODEL1, V32, V41)
"""The layouts ``sparse_mla_q8kv8_paged_fwd`` reads directly; the gather reads every one of ``LAYOUTS``."""
LAYOUTS = {layout.name: layout for layout in ALL_LAYOUTS}
LAYOUT_BY_BYTES_PER_TOKEN = {layout.bytes_per_token: layout for layout in ALL_LAYOUTS}
RECORDS_FROM, RECORDS_LAYOUT = "v41_fp4", "v41"
"""The gather turns tokens of a ``RECORDS_FROM`` cache into records of the ``RECORDS_LAYOUT`` layout (its
uint8 output, ``q8kv8.reference.fp4_rows_as_v41``), which the paged kernel reads."""


def get_layout(layout) -> KvCacheLayout:
    """``layout`` as a ``KvCacheLayout``: the object itself or its name (a key of ``LAYOUTS``)."""
    if isinstance(layout, KvCacheLayout):
        return layout
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    raise ValueError(f"layout: expected one of {sorted(LAYOUTS)} or a KvCacheLayout, got {layout!r}")
