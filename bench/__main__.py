"""Run every benchmark module: ``python -m bench [--quick]``."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

# Helper modules that the benchmarks import; each still runs alone with python -m.
SKIP = {
    "common",
    "__main__",
    "flower_deployment",
    "flower_secaggplus",
    "overlay_membership",
    "overlay_sim",
}


def main(argv: list[str]) -> int:
    names = sorted(
        m.name
        for m in pkgutil.iter_modules([str(Path(__file__).parent)])
        if m.name not in SKIP and not m.name.startswith("_")
    )
    failed = []
    for name in names:
        print(f"\n=== bench.{name} ===", flush=True)
        module = importlib.import_module(f"bench.{name}")
        try:
            module.main(argv)
        except Exception as exc:  # report and go on with the next benchmark
            print(f"bench.{name} failed: {exc!r}", file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
