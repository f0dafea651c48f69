"""The README's Quick start snippet, extracted verbatim and run against a fresh broker process."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from lmq_broker.testing import start_broker


def quick_start_snippet(readme: Path) -> str:
    section = readme.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 1, "the Quick start section holds exactly one python block"
    return str(blocks[0])


def test_readme_quick_start_runs_against_a_fresh_broker(tmp_path: Path, repo_root: Path) -> None:
    snippet = quick_start_snippet(repo_root / "README.md")
    assert len(snippet.strip().splitlines()) <= 15  # the issue asks for a 15-line example
    script = tmp_path / "quickstart.py"
    script.write_text(snippet)
    with start_broker(tmp_path / "data") as broker:  # bootstrap: AGENT_TASK_NS + executor-group
        result = subprocess.run(
            [sys.executable, str(script)],
            env={**os.environ, "LMQ_ENDPOINT": broker.endpoint},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("sent ")
    assert "session-1 hello lite" in lines, result.stdout
