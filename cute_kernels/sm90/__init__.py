"""Hopper (sm_90a) kernels.

Kernels: ``sparse_prefill`` (FP8 sparse MLA prefill), ``sparse_prefill_bf16`` (its bf16 counterpart),
``q_cast`` (bf16 queries to e4m3), ``paged_kv`` (paged FP8 KV cache to contiguous rows) and
``paged_indices`` (top-k rows to a paged cache's token slots). The
attention kernels are built from ``cta`` (CTA shape, prologue, launch), ``tile_scheduler``,
``row_views``, ``shared_storage``, ``row_gather``, ``ring``, ``named_barrier``, ``mask`` and
``epilogue``; the FP8 kernel also from ``fp8_tile`` (its tile geometry and consumer bundle), ``producer``,
``qk_products``, ``softmax_p``, ``pv_product``, ``tile_epilogue``, ``split_merge`` and ``paged_rows``.
"""
