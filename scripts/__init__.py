"""Scripts for maintainers, run as modules from the repository root (``python -m scripts.<role>.<name>``):
``bench`` (the product benchmark, ``make bench``), ``tools`` (sanitizer case, profiling, host overhead) and
``probes`` (standalone CUDA microbenchmarks, built with nvcc)."""
