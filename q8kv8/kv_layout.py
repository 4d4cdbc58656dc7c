"""The two DeepSeek paged FP8 KV cache layouts the serving path reads: byte offsets, no torch, no DSL.

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

Sources: FlashMLA ``tests/quant.py`` (``quantize_k_cache`` / ``dequantize_k_cache``), FlashMLA
``flash_mla/flash_mla_interface.py`` (the 656-byte V3.2 format), FlashMLA
``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` (MODEL1 addressing: data at ``pos * (448 + 128)``,
scales at ``page_size * 576 + pos * 8``), SGLang ``nsa/dequant_k_cache.py`` (V3.2, ``view(-1, 656)``)
and SGLang's DeepSeek V4 ``dequant_k_cache.py`` (the same MODEL1 page layout).
"""

from typing import NamedTuple


class KvCacheLayout(NamedTuple):
    """Per-token byte layout of one paged FP8 KV cache format."""

    name: str
    d_nope: int  # e4m3 values with a block scale
    d_rope: int  # bf16 values, not quantised
    scale_group: int  # nope values per scale
    scale_bytes: int  # 1 (UE8M0) or 4 (float32)
    token_bytes: int  # bytes between consecutive tokens' nope+rope data (MODEL1) or records (V3.2)
    rope_offset: int  # RoPE offset inside a token's data
    scale_offset: int | None  # scales inside a token's record (V3.2); None: in the page's scale region
    bytes_per_token: int  # the last dim of the [num_pages, page_size, 1, bytes_per_token] view

    @property
    def d_qk(self) -> int:
        return self.d_nope + self.d_rope

    @property
    def num_scales(self) -> int:
        return self.d_nope // self.scale_group

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

MODEL1 = KvCacheLayout(
    name="model1",
    d_nope=448,
    d_rope=64,
    scale_group=64,
    scale_bytes=1,
    token_bytes=448 + 64 * 2,
    rope_offset=448,
    scale_offset=None,
    bytes_per_token=448 + 64 * 2 + MODEL1_SCALE_RECORD_BYTES,
)

V32 = KvCacheLayout(
    name="v32",
    d_nope=512,
    d_rope=64,
    scale_group=128,
    scale_bytes=4,
    token_bytes=512 + 4 * 4 + 64 * 2,
    rope_offset=512 + 4 * 4,
    scale_offset=512,
    bytes_per_token=512 + 4 * 4 + 64 * 2,
)

LAYOUTS = {layout.name: layout for layout in (MODEL1, V32)}
LAYOUT_BY_BYTES_PER_TOKEN = {layout.bytes_per_token: layout for layout in (MODEL1, V32)}


def get_layout(layout) -> KvCacheLayout:
    """``layout`` as a ``KvCacheLayout``: the object itself or its name ("model1", "v32")."""
    if isinstance(layout, KvCacheLayout):
        return layout
    if isinstance(layout, str) and layout in LAYOUTS:
        return LAYOUTS[layout]
    raise ValueError(f"layout: expected one of {sorted(LAYOUTS)} or a KvCacheLayout, got {layout!r}")
