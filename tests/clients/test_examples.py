"""The runnable examples of docs/clients.md (docs/examples/<lang>), each run against a fresh broker.

Each uses the quick-start names a fresh broker bootstraps (AGENT_TASK_NS, executor-group), plaintext,
sends one lite message with a Producer and prints what its LitePushConsumer received. The Python example
is the README's Quick start, run by tests/e2e/test_quickstart.py. The official clients come from the
drivers' builds (same pinned versions, same caches).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Final

import pytest

from lmq_broker.testing import start_broker

ROOT: Final = Path(__file__).resolve().parents[2]
EXAMPLES: Final = ROOT / "docs" / "examples"


def built(lang: str) -> Path:
    """The output folder of the ``lang`` driver's build (where its client and dependencies are)."""
    pointer = ROOT / "build" / "clients" / f"{lang}.json"
    if not pointer.exists():
        pytest.fail(f"no {lang} build: run `make clients` ({pointer} is missing)")
    argv: list[str] = json.loads(pointer.read_text())
    last = argv[-1] if lang != "java" else argv[argv.index("-cp") + 1].split(":")[0]
    return Path(last).parent


def command(lang: str) -> tuple[list[str], Path, dict[str, str]]:
    if lang == "java":  # Java 11+ runs a single source file directly
        return ["java", "-cp", f"{built('java')}/lib/*", "QuickStart.java"], EXAMPLES / "java", {}
    if lang == "go":
        return ["go", "run", "-mod=readonly", "."], EXAMPLES / "go", {}
    return ["node", "quickstart.js"], EXAMPLES / "node", {"NODE_PATH": str(built("node") / "node_modules")}


@pytest.mark.parametrize("lang", ["java", "go", "node"])
def test_example_sends_and_receives_one_lite_message(lang: str, tmp_path: Path) -> None:
    argv, cwd, env = command(lang)
    with start_broker(tmp_path / "data") as broker:  # bootstrap: AGENT_TASK_NS + executor-group
        result = subprocess.run(
            argv,
            cwd=cwd,
            env={**os.environ, **env, "LMQ_ENDPOINT": broker.endpoint},
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "session-1 hello lite" in result.stdout.splitlines(), result.stdout[-2000:]
