"""Copy the CRDs (crds/*.yaml, the single source) into the chart (charts/lmq/crds/), or check for drift.

Helm installs a chart's crds/ folder verbatim, so the copies must be byte-for-byte the sources: the
check compares bytes, and reports files that are missing, stale (no longer in crds/) or different.

    python scripts/sync_chart_crds.py           # write the copies, delete stale ones
    python scripts/sync_chart_crds.py --check   # exit 1 and name every drifted file
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

SOURCE_DIR = Path("crds")
CHART_CRD_DIR = Path("charts/lmq/crds")
PATTERN = "*.yaml"


@dataclass(frozen=True)
class Drift:
    missing: tuple[str, ...]  # in crds/, not in the chart
    stale: tuple[str, ...]  # in the chart, no longer in crds/
    different: tuple[str, ...]  # in both, bytes differ

    @property
    def clean(self) -> bool:
        return not (self.missing or self.stale or self.different)

    def lines(self) -> list[str]:
        return (
            [f"missing in chart: {name}" for name in self.missing]
            + [f"stale in chart (not in {SOURCE_DIR}/): {name}" for name in self.stale]
            + [f"differs from {SOURCE_DIR}/{name}: {name}" for name in self.different]
        )


def _files(directory: Path) -> dict[str, bytes]:
    if not directory.is_dir():
        return {}
    return {path.name: path.read_bytes() for path in sorted(directory.glob(PATTERN)) if path.is_file()}


def find_drift(root: Path) -> Drift:
    sources = _files(root / SOURCE_DIR)
    copies = _files(root / CHART_CRD_DIR)
    return Drift(
        missing=tuple(sorted(sources.keys() - copies.keys())),
        stale=tuple(sorted(copies.keys() - sources.keys())),
        different=tuple(sorted(n for n in sources.keys() & copies.keys() if sources[n] != copies[n])),
    )


def sync(root: Path) -> Drift:
    """Make the chart's copies equal to the sources; returns what had to change."""
    drift = find_drift(root)
    target = root / CHART_CRD_DIR
    target.mkdir(parents=True, exist_ok=True)
    for name in drift.missing + drift.different:
        (target / name).write_bytes((root / SOURCE_DIR / name).read_bytes())
    for name in drift.stale:
        (target / name).unlink()
    return drift


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="report drift and exit 1 instead of fixing it")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this script's repository)",
    )
    args = parser.parse_args(argv)
    root: Path = args.root
    if not _files(root / SOURCE_DIR):
        print(f"no CRDs found in {root / SOURCE_DIR}", file=sys.stderr)
        return 2
    if args.check:
        drift = find_drift(root)
        for line in drift.lines():
            print(line, file=sys.stderr)
        if not drift.clean:
            print("chart CRDs drifted: run `python scripts/sync_chart_crds.py`", file=sys.stderr)
            return 1
        print(f"chart CRDs in sync with {SOURCE_DIR}/")
        return 0
    for line in sync(root).lines():
        print(f"fixed: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
