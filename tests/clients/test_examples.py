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


def java_lib(into: Path) -> Path:
    """The example's own pom (docs/examples/java/pom.xml) copies the client into ``into``, offline: the driver's
    build fetched the same pinned artifacts into ~/.m2."""
    subprocess.run(
        ["mvn", "-q", "-B", "-o", "dependency:copy-dependencies", f"-Dexamples.lib={into}"],
        cwd=EXAMPLES / "java",
        check=True,
        timeout=300,
    )
    return into


def command(lang: str, tmp_path: Path) -> tuple[list[str], Path, dict[str, str]]:
    if lang == "java":  # Java 11+ runs a single source file directly
        return ["java", "-cp", f"{java_lib(tmp_path / 'lib')}/*", "QuickStart.java"], EXAMPLES / "java", {}
    if lang == "go":
        return ["go", "run", "-mod=readonly", "."], EXAMPLES / "go", {}
    return ["node", "quickstart.js"], EXAMPLES / "node", {"NODE_PATH": str(built("node") / "node_modules")}


@pytest.mark.parametrize("lang", ["java", "go", "node"])
def test_example_sends_and_receives_one_lite_message(lang: str, tmp_path: Path) -> None:
    argv, cwd, env = command(lang, tmp_path)
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


def test_the_node_example_pins_the_client_the_suite_tests() -> None:
    example = json.loads((EXAMPLES / "node" / "package.json").read_text())
    driver = json.loads((ROOT / "tests" / "clients" / "node" / "package.json").read_text())
    assert example["dependencies"] == driver["dependencies"]
    lock = json.loads((EXAMPLES / "node" / "package-lock.json").read_text())
    assert lock["packages"]["node_modules/rocketmq-client-nodejs"]["version"] == "1.0.8"
