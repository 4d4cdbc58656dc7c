"""Standalone measurements: CUDA microbenchmarks (built with nvcc) and numerical probes."""
