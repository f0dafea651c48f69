"""Each program installs only what it runs, and runs with what it installs: the extras of pyproject.toml, the
pinned requirements/<program>.txt the images and `make` install from, and the imports of each program's code.

The imports are read from the source (grimp, import-linter's graph: every import, including the ones inside
functions, but not those under TYPE_CHECKING), so an import added to the broker that its lock does not install
fails here rather than in a pod; and the broker's lock shows it never gets PySpark or a Kubernetes client.
"""

from __future__ import annotations

import re
import sys
import tomllib
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Final

import grimp
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

# A program's entry modules: everything its image runs (`python -m ...` and console scripts).
PROGRAMS: Final = {
    "broker": ("lmq_broker.__main__", "lmq_broker.admin.cli", "lmq_broker.roundtrip"),
    "operator": ("lmq_operator.__main__",),
    "reclaim": ("lmq_reclaim.__main__", "lmq_reclaim.warmup"),
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, Version]:
    pinned = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith((" ", "#")):
            name, _, rest = line.partition("==")
            pinned[normalize(name.strip())] = Version(rest.split(";")[0].strip())
    return pinned


@pytest.fixture(scope="module")
def project(repo_root: Path) -> dict[str, object]:
    loaded: dict[str, object] = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    return loaded


@pytest.fixture(scope="module")
def locks(repo_root: Path) -> dict[str, dict[str, Version]]:
    return {name: pins(repo_root / "requirements" / f"{name}.txt") for name in (*PROGRAMS, "dev")}


@cache
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        "lmq_broker", "lmq_operator", "lmq_reclaim", include_external_packages=True, exclude_type_checking_imports=True
    )


def third_party_imports(entries: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for entry in entries:
        found |= {m.split(".")[0] for m in graph().find_upstream_modules(entry)}
    return {m for m in found if not m.startswith("lmq_") and m not in sys.stdlib_module_names}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_program_imports_only_what_its_lock_installs(program: str, locks: dict[str, dict[str, Version]]) -> None:
    providers = metadata.packages_distributions()
    imported = third_party_imports(PROGRAMS[program])
    assert "grpc" in imported  # the walk really reached the programs' imports
    missing = {
        module: providers.get(module, [])
        for module in imported
        if not {normalize(d) for d in providers.get(module, [])} & locks[program].keys()
    }
    assert missing == {}, f"{program} imports these, its lock installs none of their distributions"


def test_the_broker_never_imports_spark_kubernetes_or_kopf() -> None:
    assert third_party_imports(PROGRAMS["broker"]) & {"pyspark", "pyarrow", "pandas", "kubernetes", "kopf"} == set()
    assert third_party_imports(PROGRAMS["operator"]) & {"pyspark", "pyarrow", "rocksdict"} == set()


@pytest.mark.parametrize("program", [*sorted(PROGRAMS), "dev"])
def test_a_lock_pins_every_requirement_of_its_extra_within_its_range(
    program: str, project: dict[str, object], locks: dict[str, dict[str, Version]]
) -> None:
    extras: dict[str, list[str]] = project["optional-dependencies"]  # type: ignore[assignment]
    wanted = [Requirement(r) for r in [*project["dependencies"], *extras[program]]]  # type: ignore[misc]
    for requirement in wanted:
        name = normalize(requirement.name)
        if name == "lmq":  # dev = the other extras (checked through their own locks below) + tools
            assert set(requirement.extras) == set(PROGRAMS)
            continue
        assert name in locks[program], f"{program}.txt does not pin {requirement}"
        assert requirement.specifier.contains(locks[program][name], prereleases=True), (
            f"{program}.txt pins {name}=={locks[program][name]}, outside {requirement}"
        )


def test_the_programs_locks_agree_with_the_dev_lock(locks: dict[str, dict[str, Version]]) -> None:
    """`make run` and `make test` share a virtualenv: neither may move a version the other installed."""
    for program in PROGRAMS:
        differ = {n: (v, locks["dev"].get(n)) for n, v in locks[program].items() if locks["dev"].get(n) != v}
        assert differ == {}, f"{program}.txt vs dev.txt: {differ}"


def test_make_run_installs_the_broker_and_make_test_everything(repo_root: Path) -> None:
    makefile = (repo_root / "Makefile").read_text()

    def rule(target: str) -> str:
        match = re.search(rf"^{re.escape(target)}:(.*)\n((?:\t.*\n)*)", makefile, re.MULTILINE)
        assert match, target
        return match.group(0)

    # the broker's pins, and the native edge (the default) where cargo is; without it serve falls back to grpcio's
    assert rule("run").split("\n")[0].split(":", 1)[1].split() == ["$(BROKER_STAMP)", "native-if-cargo"]
    assert "-e '.[broker]' -c requirements/broker.txt" in rule("$(BROKER_STAMP)")
    assert "requirements/broker.txt" in rule("$(BROKER_STAMP)").split("\n")[0]  # a new pin reinstalls
    assert "-e '.[dev]' -c requirements/dev.txt" in rule("$(STAMP)")
    assert {"$(STAMP)", "lock-check", "native"} <= set(rule("test").split("\n")[0].split(":", 1)[1].split())
