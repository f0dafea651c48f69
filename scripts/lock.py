"""Pin each program's dependencies in requirements/<program>.txt with uv, or check the pins against pyproject.toml.

A program installs from its own file: the broker image and `make run` from broker.txt (no PySpark, no JVM, no
Kubernetes client), the operator image from operator.txt, the reclaim image from reclaim.txt, `make test` from
dev.txt (every program and the tools). Each file is resolved for every platform (``--universal``) and Python
3.11. uv keeps the versions a file already pins while they still satisfy pyproject.toml, so writing again
changes nothing until pyproject.toml does, and then only what has to move; ``--upgrade`` moves every pin to the
newest version allowed. ``--check`` resolves into a scratch copy and names every file that differs: a
pyproject.toml edited without ``make lock``. Resolving reads the package index (PyPI).

    python scripts/lock.py            # write requirements/*.txt   (make lock)
    python scripts/lock.py --check    # exit 1 naming each file that drifted   (make lock-check, make test)
    python scripts/lock.py --upgrade  # newest allowed versions
"""

from __future__ import annotations

import argparse
import difflib
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[1]
LOCK_DIR: Final = Path("requirements")
PROGRAMS: Final = ("broker", "operator", "reclaim", "dev")  # one extra of pyproject.toml each
PYTHON_VERSION: Final = "3.11"


def uv() -> str:
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if found is None:
        raise SystemExit("uv is not installed: `make` installs it into .venv (the dev extra)")
    return found


def compile_lock(program: str, output: Path, upgrade: bool) -> None:
    command = [
        uv(), "pip", "compile", "pyproject.toml", "--extra", program, "--universal",
        "--python-version", PYTHON_VERSION, "--custom-compile-command", "make lock", "--quiet",
        "--output-file", str(output),
    ]  # fmt: skip
    if upgrade:
        command.append("--upgrade")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"uv pip compile --extra {program} failed:\n{done.stderr.strip()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail, naming each lock file that drifted")
    mode.add_argument("--upgrade", action="store_true", help="move every pin to the newest allowed version")
    args = parser.parse_args()
    if not args.check:
        (ROOT / LOCK_DIR).mkdir(exist_ok=True)
        for program in PROGRAMS:
            compile_lock(program, LOCK_DIR / f"{program}.txt", args.upgrade)
            print(f"wrote {LOCK_DIR / program}.txt")
        return 0
    drifted = []
    with tempfile.TemporaryDirectory(prefix="lmq-lock-") as scratch:
        for program in PROGRAMS:
            committed = ROOT / LOCK_DIR / f"{program}.txt"
            fresh = Path(scratch) / f"{program}.txt"
            if committed.exists():
                shutil.copy(committed, fresh)  # its pins are the preferences, as when writing
            compile_lock(program, fresh, upgrade=False)
            old = committed.read_text().splitlines(keepends=True) if committed.exists() else []
            new = fresh.read_text().splitlines(keepends=True)
            if old != new:
                drifted.append(committed.relative_to(ROOT))
                sys.stdout.writelines(difflib.unified_diff(old, new, str(committed.relative_to(ROOT)), "resolved"))
    if drifted:
        print(f"drifted from pyproject.toml: {', '.join(map(str, drifted))}; run `make lock`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
