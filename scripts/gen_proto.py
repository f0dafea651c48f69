"""Generate Python stubs from proto/ into broker/lmq_broker/protocol/gen (one source, drift-checked).

python scripts/gen_proto.py          # regenerate
python scripts/gen_proto.py --check  # fail if the committed stubs differ from what proto/ generates
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "broker" / "lmq_broker" / "protocol" / "gen"
GEN_PACKAGE = "lmq_broker.protocol.gen"
_IMPORT_RE = re.compile(r"^(from|import) (apache\.rocketmq\.v2|lmq\.admin\.v1)\b", re.MULTILINE)


def _generate(out: Path) -> None:
    bindir = Path(sys.executable).parent
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in PROTO_DIR.rglob("*.proto"))
    well_known = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
        f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for path in out.rglob("*.py*"):
        text = path.read_text()
        fixed = _IMPORT_RE.sub(lambda m: f"{m.group(1)} {GEN_PACKAGE}.{m.group(2)}", text)
        if fixed != text:
            path.write_text(fixed)
    for folder in [out, *[p for p in out.rglob("*") if p.is_dir()]]:
        init = folder / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from proto/ by scripts/gen_proto.py; never edit."""\n')


def _differences(a: Path, b: Path) -> list[str]:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    diffs = [f"only in proto output: {p}" for p in sorted(files_a - files_b)]
    diffs += [f"not generated from proto/: {p}" for p in sorted(files_b - files_a)]
    diffs += [f"stale: {p}" for p in sorted(files_a & files_b) if not filecmp.cmp(a / p, b / p, shallow=False)]
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when stale")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "gen"
        fresh.mkdir()
        _generate(fresh)
        if ns.check:
            diffs = _differences(fresh, OUT_DIR)
            if diffs:
                print("generated stubs are stale; run `make proto`:\n  " + "\n  ".join(diffs))
                return 1
            print("generated stubs match proto/")
            return 0
        shutil.rmtree(OUT_DIR, ignore_errors=True)
        shutil.copytree(fresh, OUT_DIR)
        print(f"generated {sum(1 for _ in OUT_DIR.rglob('*.py*'))} files into {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
