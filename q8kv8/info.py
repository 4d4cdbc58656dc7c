"""``python -m q8kv8.info`` and ``q8kv8.info()``: what this installation runs with.

Versions (q8kv8, torch and its CUDA, the CuTe DSL, TVM-FFI, cuda-python, ptxas), the GPU and its arch
(or "none"), the kernel variants (``q8kv8.kernels.listed_variants()``: where each came from,
registers per thread from ``ptxas -v``, which runs once per variant and ptxas and is kept in the cache
(``q8kv8.build.ptxas_report``), shared memory per CTA), the disk cache (location, this process's
hits and misses) and the schedule rules (``q8kv8.schedule.describe`` names the schedule of a call).

``info()`` returns a ``Report``: a dict that prints as a table (``print(q8kv8.info())``), the table that
``python -m q8kv8.info`` prints. The module is callable, so ``q8kv8.info()`` is ``q8kv8.info.info()``.
"""

import importlib.metadata
import re
import sys
import types

import torch


class Report(dict):
    """What ``info()`` returns: a dict (``report["versions"]``, ``report["variants"]``, ...) whose ``str`` and
    ``repr`` are the table of ``python -m q8kv8.info``, so that printing it or showing it in a REPL is
    readable; ``dict(report)`` is the plain dict."""

    def __str__(self) -> str:
        return _table(self)

    __repr__ = __str__


def info() -> Report:
    """Versions, GPU, kernel variants and cache of this installation (builds or loads the variants)."""
    from q8kv8 import build, disk_cache, kernels, metadata, native, schedule
    from q8kv8.metadata import __version__

    variants = kernels.listed_variants()
    fast_path_built = native.load() is not None
    gpu, arch = "none", "none"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        gpu, arch = torch.cuda.get_device_name(), f"sm_{major}{minor}"
    report = {
        "versions": {
            "q8kv8": __version__,
            "torch": torch.__version__,
            "cuda (torch build)": torch.version.cuda or "none",
            "nvidia-cutlass-dsl": _distribution_version("nvidia-cutlass-dsl"),
            "apache-tvm-ffi": _distribution_version("apache-tvm-ffi"),
            "cuda-python": _distribution_version("cuda-python"),
            "ptxas": _ptxas_version(),
        },
        "gpu": gpu,
        "arch": arch,
        "target_arch": build.TARGET_ARCH,
        "variants": [kernels.describe(variant) for variant in variants],
        "cache": {
            "dir": str(disk_cache.cache_dir()),
            "hits": kernels.cache_stats.hits,
            "misses": kernels.cache_stats.misses,
            "rebuilt_corrupt": kernels.cache_stats.rebuilt_corrupt,
        },
        "fast_path": "built" if fast_path_built else "unavailable (every call takes the Python path)",
        "schedules": {  # the rules of q8kv8.schedule; schedule.describe(...) names a call's
            "persistent": f"topk <= {schedule.PERSISTENT_MAX_TOPK} or topk_length given, and at least "
            f"{2 * schedule.PERSISTENT_MIN_WAVES} waves of tiles: up to "
            f"{schedule.PERSISTENT_MAX_TILES_PER_CTA} tiles per CTA",
            "split": f"one-tile grids of at most half as many tiles as SMs: each tile in "
            f"{' or '.join(map(str, schedule.SPLIT_PARTS))} parts of >= {schedule.SPLIT_MIN_SLOTS} index "
            "slots, one cluster of CTAs a tile; longer ones with topk >= "
            f"{schedule.SPLIT_TAIL_MIN_TOPK}: the tokens of their last, partial wave so, in a launch after "
            "the others'",
            "small_heads": f"h_q in {metadata.SMALL_HEAD_COUNTS}: the small-head kernel (a tile is a "
            "token's heads), "
            f"persistent: up to {schedule.SMALL_HEAD_MAX_TILES_PER_CTA} tokens per CTA, the count that keeps "
            "the fewest tokens in a row on an SM",
        },
    }
    return Report(report)


def _distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _ptxas_version() -> str:
    from q8kv8 import build

    text = build.ptxas_version()
    if text is None:
        return "not on PATH"
    match = re.search(r"release ([\d.]+)", text)
    return match.group(1) if match else "unknown"


def _table(report: dict) -> str:
    lines = []
    width = max(len(name) for name in report["versions"])
    for name, version in report["versions"].items():
        lines.append(f"{name:{width}s}  {version}")
    gpu = report["gpu"] if report["gpu"] == "none" else f"{report['gpu']} ({report['arch']})"
    lines.append(f"{'gpu':{width}s}  {gpu}; kernels built for {report['target_arch']}")
    cache = report["cache"]
    lines.append(
        f"{'cache':{width}s}  {cache['dir']} (this process: {cache['hits']} hits, {cache['misses']} misses, "
        f"{cache['rebuilt_corrupt']} rebuilt)"
    )
    lines.append(f"{'fast path':{width}s}  {report['fast_path']}")
    for kind, rule in report["schedules"].items():
        lines.append(f"{kind:{width}s}  {rule}")
    name_width = max(32, *(len(variant["name"]) for variant in report["variants"]))
    header = (
        f"{'variant':{name_width}s} {'d_qk':>5s} {'from':9s} {'seconds':>8s} {'regs':>5s} {'spills':>7s} "
        f"{'smem B':>8s}"
    )
    lines.append(f"\n{header}")
    for variant in report["variants"]:
        lines.append(
            f"{variant['name']:{name_width}s} {variant['d_qk']:5d} {variant['source']:9s} "
            f"{variant['seconds']:8.3f} "
            f"{_or_na(variant['registers']):>5s} {_or_na(variant['spill_bytes']):>7s} "
            f"{variant['shared_memory_bytes']:8d}"
        )
    return "\n".join(lines)


def main() -> int:
    print(info())
    return 0


def _or_na(value) -> str:
    return "n/a" if value is None else str(value)


class _CallableModule(types.ModuleType):
    """Makes ``q8kv8.info()`` call ``info()`` although ``q8kv8.info`` is this module."""

    def __call__(self) -> Report:
        return info()


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
