"""Write the CRDs and the spec field tables of docs/operator.md from the operator's models, or check for drift.

The models (operator/lmq_operator/model.py, built into schemas by lmq_operator.crd) are the single source.
Helm installs a chart's crds/ folder verbatim, so the chart gets the same bytes as crds/; the check reports
files that are missing, stale (a CRD no longer generated) or different, in both folders and the docs.

    python scripts/gen_crds.py           # write crds/, charts/lmq/crds/ and the tables of docs/operator.md
    python scripts/gen_crds.py --check   # exit 1 and name every drifted file
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from lmq_operator import crd, model

CRD_DIRS = (Path("crds"), Path("charts/lmq/crds"))
DOCS = Path("docs/operator.md")
BEGIN, END = "<!-- crd-fields:begin (scripts/gen_crds.py) -->", "<!-- crd-fields:end -->"
PATTERN = "*.yaml"


class _Dumper(yaml.SafeDumper):
    """Block style with indented sequences; lists of scalars on one line; CEL in double quotes."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = '"' if "'" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.Node:
    flat = all(isinstance(v, str | int | bool) for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flat)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)


def render(resource: crd.Resource) -> str:
    header = (
        f"# {resource.kind.value}: generated from operator/lmq_operator/model.py by scripts/gen_crds.py\n"
        "# (`make crds`); do not edit. Apply with `kubectl apply --server-side -f crds/`.\n"
    )
    return header + yaml.dump(crd.manifest(resource), Dumper=_Dumper, sort_keys=False, width=1 << 16)


def file_name(resource: crd.Resource) -> str:
    return f"{model.GROUP}_{resource.kind.plural}.yaml"


def field_tables() -> str:
    parts = []
    for resource in crd.RESOURCES:
        lines = [
            f"`{resource.kind.value}` spec:",
            "",
            "| field | type | default | limits | description |",
            "|---|---|---|---|---|",
        ]
        for row in crd.field_rows(resource):
            default = f"`{row.default}`" if row.default not in ("", "required") else row.default
            cells = [f"`{row.path}`", row.type, default, row.limits, row.description]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def with_tables(docs: str) -> str:
    begin, end = docs.find(BEGIN), docs.find(END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{DOCS}: the markers {BEGIN} / {END} are missing")
    return docs[: begin + len(BEGIN)] + "\n" + field_tables() + "\n" + docs[end:]


def expected(root: Path) -> dict[Path, str]:
    """Every generated file (relative to ``root``) and its text."""
    files = {folder / file_name(r): render(r) for folder in CRD_DIRS for r in crd.RESOURCES}
    files[DOCS] = with_tables((root / DOCS).read_text())
    return files


@dataclass(frozen=True)
class Drift:
    missing: tuple[Path, ...]
    stale: tuple[Path, ...]  # a CRD file nothing generates any more
    different: tuple[Path, ...]

    @property
    def clean(self) -> bool:
        return not (self.missing or self.stale or self.different)

    def lines(self) -> list[str]:
        return (
            [f"missing: {p}" for p in self.missing]
            + [f"stale (not generated): {p}" for p in self.stale]
            + [f"differs from what the models generate: {p}" for p in self.different]
        )


def find_drift(root: Path, files: dict[Path, str]) -> Drift:
    present = {p.relative_to(root) for folder in CRD_DIRS for p in (root / folder).glob(PATTERN) if p.is_file()}
    return Drift(
        missing=tuple(sorted(p for p in files if not (root / p).is_file())),
        stale=tuple(sorted(present - files.keys())),
        different=tuple(
            sorted(p for p, text in files.items() if (root / p).is_file() and (root / p).read_text() != text)
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="report drift and exit 1 instead of writing")
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this script's repository)",
    )
    args = parser.parse_args(argv)
    root: Path = args.root
    if not (root / DOCS).is_file():
        print(f"no {DOCS} under {root}: --root must be a checkout of the repository", file=sys.stderr)
        return 2
    files = expected(root)
    drift = find_drift(root, files)
    if args.check:
        for line in drift.lines():
            print(line, file=sys.stderr)
        if not drift.clean:
            print("CRDs drifted from the models: run `make crds` (python scripts/gen_crds.py)", file=sys.stderr)
            return 1
        print("CRDs and docs in sync with the models")
        return 0
    for path in drift.missing + drift.different:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(files[path])
    for path in drift.stale:
        (root / path).unlink()
    for line in drift.lines():
        print(f"fixed: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
