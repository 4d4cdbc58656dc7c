"""The PTX manifest: the SHA-256 of every listed kernel variant's PTX (``tests/ptx_manifest.json``).

A change that only moves code (a refactor of the kernel classes, the host path, the shared parts) keeps every
variant's PTX byte for byte; ``tests/test_kernel_build.py`` compares the built PTX with the manifest and
names each variant whose PTX changed. A change that is meant to change kernels rewrites the manifest here and
says in its commit which variants changed, and why. PTX depends only on the sources and the CuTe DSL version
(the manifest records it; the check skips under another one).

    python -m scripts.tools.ptx_manifest          # build or load every variant, write the manifest
    python -m scripts.tools.ptx_manifest --check  # list the variants whose PTX differs from it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MANIFEST = Path(__file__).resolve().parent.parent.parent / "tests" / "ptx_manifest.json"


def dsl_version() -> str:
    from q8kv8.build import import_dsl

    cutlass, _ = import_dsl()
    return cutlass.__version__


def ptx_hashes(variants) -> dict[str, str]:
    """Variant name -> SHA-256 of its kept PTX, for the variants that keep one."""
    from q8kv8 import disk_cache

    return {v.name: disk_cache.sha256(v.ptx_path) for v in variants if v.ptx_path is not None}


def read_manifest(path: Path = MANIFEST) -> dict:
    return json.loads(path.read_text())


def differences(recorded: dict[str, str], built: dict[str, str]) -> list[str]:
    """Lines naming each variant whose PTX differs from the recorded one, is not recorded, or is recorded
    but was not built; empty when they agree."""
    changed = [name for name in sorted(built) if name in recorded and recorded[name] != built[name]]
    lines = [f"changed: {name}" for name in changed]
    lines += [f"not in the manifest: {name}" for name in sorted(set(built) - set(recorded))]
    lines += [f"not built: {name}" for name in sorted(set(recorded) - set(built))]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the manifest instead of writing it"
    )
    args = parser.parse_args(argv)
    from q8kv8 import kernels

    built = ptx_hashes(kernels.listed_variants())
    if args.check:
        manifest = read_manifest()
        lines = differences(manifest["variants"], built)
        if manifest["dsl"] != dsl_version():
            lines.insert(0, f"the manifest is of CuTe DSL {manifest['dsl']}, this is {dsl_version()}")
        print("\n".join(lines) if lines else f"PTX of all {len(built)} variants as recorded")
        return 1 if lines else 0
    manifest = {"dsl": dsl_version(), "variants": built}
    MANIFEST.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(f"wrote {MANIFEST.name}: {len(built)} variants")
    return 0


if __name__ == "__main__":
    sys.exit(main())
