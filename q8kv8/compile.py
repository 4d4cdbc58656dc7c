"""``python -m q8kv8.compile``: build every kernel variant ahead of time, into the disk cache.

Run it once per machine (or in a container build) so that no process pays the compile: it builds each
attention variant (``q8kv8.kernels.listed_variants()``: those for a bfloat16 q too, when the kernel takes
one) for sm_90a (no GPU needed) or loads it when the cache already holds it, and prints, for each,
its name, where it came from (``compiled`` or ``cache``) and the seconds it took, then the cache
location. The cache is ``$Q8KV8_CACHE_DIR`` (default ``~/.cache/q8kv8``); see ``q8kv8.build``.

Exits with status 1, printing the one-line ``KernelCompileError``, when a variant fails to build.
"""

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m q8kv8.compile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    from q8kv8 import build, disk_cache, kernels

    try:
        variants = kernels.listed_variants()
    except build.KernelCompileError as error:
        print(error, file=sys.stderr)
        return 1
    width = max(32, *(len(variant.name) for variant in variants))
    print(f"{'variant':{width}s} {'from':9s} {'seconds':>8s}")
    for variant in variants:
        print(f"{variant.name:{width}s} {variant.source:9s} {variant.seconds:8.3f}")
    print(f"cache: {disk_cache.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
