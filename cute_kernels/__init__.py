"""CuTe DSL kernels for q8kv8 (no torch imports here beyond what DLPack hand-off needs).

- ``sm90.sparse_prefill``: the SM90 FP8 sparse MLA prefill kernel class.
- ``ptx``: small inline-PTX helpers the kernels share (cp.async with zero-fill, ldmatrix,
  byte permutes, FP8 packing, raw shared/global stores).
"""
