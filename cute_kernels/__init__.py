"""CuTe DSL kernels for q8kv8 (no torch imports here beyond what DLPack hand-off needs).

- ``sm90``: the Hopper (sm_90a) kernels and the parts they are built from.
- ``ptx``: small inline-PTX helpers the kernels share (cp.async with zero fill, ldmatrix, byte
  permutes, FP8 packing, raw shared / global loads and stores).
"""
