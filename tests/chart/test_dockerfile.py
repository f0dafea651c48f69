"""The Dockerfile, checked without a Docker engine: parsed here, its build context reproduced from
.dockerignore, the project built from exactly that context, and its entrypoints run from the source.

The parser covers the Dockerfile syntax we use (continuation lines, comments inside them, exec and shell
forms, instruction flags, ARG substitution); a heredoc or an unknown instruction fails the parse rather
than being misread. The .dockerignore matcher follows BuildKit's rules: patterns are Go filepath.Match
globs plus "**", a path is excluded when it or one of its parent directories matches, "!" re-includes,
and the last matching pattern wins.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]

ENTRYPOINT_MODULES = ("lmq_broker", "lmq_operator", "lmq_reclaim", "lmq_broker.roundtrip")
TARGETS = ("broker", "operator", "reclaim")  # one image per program, each named after its Dockerfile target
# Build-only stages: the toolchain image and the native edge's wheel (compiled there, only the wheel leaves).
RUST_STAGE, NATIVE_STAGE = "rust", "native-edge"
NATIVE_CRATE = "native/edge"
# Distributions that must never reach an image that does not run them (lock file names, normalized).
NOT_IN = {
    "broker": {"pyspark", "py4j", "pyarrow", "pandas", "numpy", "kopf", "kubernetes"},
    "operator": {"pyspark", "py4j", "pyarrow", "pandas", "rocksdict", "crc32c"},
    "reclaim": {"kopf", "rocksdict", "crc32c"},
}
KNOWN_INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}  # fmt: skip


# -- a Dockerfile parser


@dataclass(frozen=True)
class Instruction:
    keyword: str
    flags: dict[str, str]
    value: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction, or None for the shell form."""
        if not self.value.startswith("["):
            return None
        parsed = json.loads(self.value)
        assert isinstance(parsed, list) and all(isinstance(p, str) for p in parsed), self
        return parsed

    def words(self) -> list[str]:
        return self.exec_form() or shlex.split(self.value)


@dataclass(frozen=True)
class Stage:
    base: str
    name: str | None
    instructions: tuple[Instruction, ...]

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"no {keyword} in stage {self.name or self.base}"
        return found[-1]


@dataclass(frozen=True)
class Dockerfile:
    args: dict[str, str]  # ARGs declared before the first FROM, with their defaults
    stages: tuple[Stage, ...]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        (found,) = [s for s in self.stages if s.name == name]
        return found

    def chain(self, name: str) -> list[Stage]:
        """Every stage a target is built from: its own, its FROM bases and the stages it copies from."""
        names = [s.name for s in self.stages]
        seen: list[Stage] = []
        pending = [name]
        while pending:
            stage = self.stage(pending.pop())
            if stage in seen:
                continue
            seen.append(stage)
            pending += [stage.base] if stage.base in names else []
            pending += [i.flags["from"] for i in stage.all("COPY") if i.flags.get("from") in names]
        return seen

    def lineage(self, name: str) -> list[Stage]:
        """The stages whose layers a target's image is made of: its own and its FROM bases (not COPY --from)."""
        names = [s.name for s in self.stages]
        found = [self.stage(name)]
        while found[-1].base in names:
            found.append(self.stage(found[-1].base))
        return found

    def inherited(self, name: str, keyword: str) -> Instruction:
        """The instruction a target's image ends up with: its own, else its FROM base's, and so on."""
        stage = self.stage(name)
        while not stage.all(keyword):
            stage = self.stage(stage.base)
        return stage.last(keyword)


_VARIABLE = re.compile(r"\$(?:\{(?P<braced>\w+)(?::-(?P<default>[^}]*))?\}|(?P<bare>\w+))")


def substitute(text: str, variables: dict[str, str]) -> str:
    def replace(match: re.Match[str]) -> str:
        name = match.group("braced") or match.group("bare")
        value = variables.get(name, "")
        return value or (match.group("default") or "")

    return _VARIABLE.sub(replace, text)


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """Join continuation lines; comment lines (even inside a continuation) are dropped, as Docker does."""
    buffer: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or not stripped:  # a blank line does not end a continuation either
            continue
        if not buffer:
            start = number
        if stripped.endswith("\\"):
            buffer.append(stripped[:-1].strip())
            continue
        buffer.append(stripped)
        yield start, " ".join(part for part in buffer if part)
        buffer = []
    assert not buffer, "the Dockerfile ends inside a continuation line"


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    current: list[Instruction] = []
    header: tuple[str, str | None] | None = None
    for line, content in logical_lines(text):
        keyword, _, rest = content.partition(" ")
        keyword = keyword.upper()
        assert keyword in KNOWN_INSTRUCTIONS, f"line {line}: unknown instruction {keyword}"
        assert "<<" not in rest or keyword != "RUN" or not re.search(r"<<-?\s*['\"]?\w+['\"]?\s*$", rest), (
            f"line {line}: heredocs are not supported by this parser"
        )
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            rest = rest.strip()
        instruction = Instruction(keyword, flags, rest, line)
        if keyword == "FROM":
            if header is not None:
                stages.append(Stage(header[0], header[1], tuple(current)))
            words = rest.split()
            base = substitute(words[0], global_args)
            stage_name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"line {line}: FROM {rest}"
            header, current = (base, stage_name), []
        elif header is None:
            assert keyword == "ARG", f"line {line}: only ARG may come before the first FROM"
            arg_name, _, default = rest.partition("=")
            global_args[arg_name] = default
        else:
            current.append(instruction)
    assert header is not None, "no FROM"
    stages.append(Stage(header[0], header[1], tuple(current)))
    return Dockerfile(global_args, tuple(stages))


def test_parser_reads_our_syntax() -> None:
    parsed = parse_dockerfile(
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE} AS build\n"
        "RUN apt-get update \\\n"
        "    # a comment inside the continuation\n"
        "    && apt-get install -y x \\\n"
        "\n"
        "    && true\n"
        "COPY --from=build --chown=1:1 /a /b\n"
        "FROM $BASE\n"
        'ENTRYPOINT ["python", "-m"]\n'
        "CMD lmq_broker serve\n"
    )
    assert parsed.args == {"BASE": "python:3.11-slim"}
    assert [(s.base, s.name) for s in parsed.stages] == [("python:3.11-slim", "build"), ("python:3.11-slim", None)]
    run, copy = parsed.stages[0].instructions
    assert run.value == "apt-get update && apt-get install -y x && true"
    assert (copy.flags, copy.words()) == ({"from": "build", "chown": "1:1"}, ["/a", "/b"])
    assert parsed.final.last("ENTRYPOINT").exec_form() == ["python", "-m"]
    assert parsed.final.last("CMD").exec_form() is None
    assert parsed.final.last("CMD").words() == ["lmq_broker", "serve"]
    with pytest.raises(AssertionError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN true\n")
    with pytest.raises(AssertionError, match="heredocs"):
        parse_dockerfile("FROM x\nRUN <<EOF\ntrue\nEOF\n")


# -- a .dockerignore matcher


@dataclass(frozen=True)
class IgnorePattern:
    text: str
    regex: re.Pattern[str]
    exclusion: bool  # a "!" pattern: re-includes what it matches


def _glob_to_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                i += 1
                out += "(?:.*/)?" if i < len(pattern) else ".*"
            else:
                out += ".*"
            continue
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        elif char == "[":
            end = pattern.index("]", i + 1)
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        elif char == "\\":
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(char)
        i += 1
    return re.compile(f"^{out}$")


class DockerIgnore:
    def __init__(self, text: str) -> None:
        self.patterns: list[IgnorePattern] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            exclusion = line.startswith("!")
            line = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
            self.patterns.append(IgnorePattern(line, _glob_to_regex(line), exclusion))

    def excluded(self, path: str) -> bool:
        parts = path.strip("/").split("/")
        candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]  # parents first, then the path
        excluded = False
        for pattern in self.patterns:
            if any(pattern.regex.match(candidate) for candidate in candidates):
                excluded = not pattern.exclusion
        return excluded

    def prunable(self, directory: str) -> bool:
        """True when nothing under an excluded directory can be re-included (BuildKit skips it too)."""
        if not self.excluded(directory):
            return False
        top = directory.split("/", maxsplit=1)[0]
        for pattern in self.patterns:
            first = pattern.text.split("/")[0]
            if pattern.exclusion and (first == top or any(c in first for c in "*?[\\")):
                return False
        return True


def test_dockerignore_matcher_follows_buildkit_rules() -> None:
    ignore = DockerIgnore("# comment\n*\n!src/\n**/__pycache__\n!src/keep/__pycache__\n/docs/*.md\n!README*\n")
    assert ignore.excluded("tests/test_x.py")  # "*" matches the top-level directory
    assert not ignore.excluded("src/pkg/mod.py")  # "!src" re-includes the directory and its files
    assert ignore.excluded("src/pkg/__pycache__/mod.pyc")  # a matching parent directory excludes
    assert not ignore.excluded("src/keep/__pycache__/x.pyc")  # the last matching pattern wins
    assert ignore.excluded("docs/a.md")
    assert not ignore.excluded("README.md")
    assert _glob_to_regex("a/**/b").match("a/b") and _glob_to_regex("a/**/b").match("a/x/y/b")
    assert not _glob_to_regex("a/*/b").match("a/x/y/b")
    assert _glob_to_regex("file[0-9].txt").match("file7.txt")
    assert not _glob_to_regex("file[^0-9].txt").match("file7.txt")
    # Pruning is conservative: a wildcard exception ("!README*") keeps every excluded directory walked.
    assert not ignore.prunable("tests") and not ignore.prunable("src")
    allow_list = DockerIgnore("*\n!src/\n**/__pycache__\n")
    assert allow_list.prunable("tests") and allow_list.prunable(".venv")
    assert not allow_list.prunable("src") and not allow_list.prunable("src/pkg")


# -- fixtures


@pytest.fixture(scope="module")
def dockerfile(repo_root: Path) -> Dockerfile:
    return parse_dockerfile((repo_root / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def dockerignore(repo_root: Path) -> DockerIgnore:
    return DockerIgnore((repo_root / ".dockerignore").read_text())


@pytest.fixture(scope="module")
def context_files(repo_root: Path, dockerignore: DockerIgnore) -> set[str]:
    """The files `docker build .` would send: every file of the checkout not excluded by .dockerignore."""
    files = set()
    for directory, subdirectories, names in os.walk(repo_root):
        relative = Path(directory).relative_to(repo_root).as_posix()
        if relative == ".":
            subdirectories[:] = [d for d in subdirectories if d != ".git"]
            relative = ""
        subdirectories[:] = [d for d in subdirectories if not dockerignore.prunable(f"{relative}/{d}".lstrip("/"))]
        for name in names:
            path = f"{relative}/{name}".lstrip("/")
            if not dockerignore.excluded(path):
                files.add(path)
    return files


@pytest.fixture(scope="module")
def tracked_files(repo_root: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=repo_root,
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in listed.stdout.splitlines() if (repo_root / line).is_file()]


# -- the images


def lock_names(path: Path) -> set[str]:
    """Distribution names pinned in a requirements file (normalized as PEP 503 says)."""
    names = set()
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith((" ", "#")):
            names.add(re.sub(r"[-_.]+", "-", line.split("==")[0].strip()).lower())
    return names


def test_one_target_per_program_on_one_python_base(dockerfile: Dockerfile) -> None:
    names = [s.name for s in dockerfile.stages]
    assert set(TARGETS) <= set(names)
    assert dockerfile.final.name == "broker"  # `docker build .` builds the broker
    base = dockerfile.args["PYTHON_IMAGE"]
    for index, stage in enumerate(dockerfile.stages):
        if stage.name == RUST_STAGE:  # only its toolchain is copied out, into the native edge's build stage
            assert stage.base == dockerfile.args["RUST_IMAGE"] and stage.instructions == ()
            continue
        # A virtualenv built in one stage must find its interpreter at the same path in another.
        assert stage.base == base or stage.base in names[:index], (stage.name, stage.base)
    assert re.fullmatch(r"python:3\.11-slim(-bookworm)?", base), base
    # OpenJDK 17 is packaged in Debian bookworm; an unpinned slim tag may move to a release without it.
    assert base.endswith("-bookworm")
    # A pinned toolchain on the same Debian release as the base its binaries and the wheel's builder run on.
    assert re.fullmatch(r"rust:1\.\d+(\.\d+)?-slim-bookworm", dockerfile.args["RUST_IMAGE"])


def test_only_the_reclaim_image_carries_a_java_runtime(dockerfile: Dockerfile) -> None:
    for target in TARGETS:
        installs = [i.value for s in dockerfile.lineage(target) for i in s.all("RUN") if "apt-get install" in i.value]
        built_with = " ".join(i.value for s in dockerfile.chain(target) for i in s.all("RUN"))
        if target != "reclaim":
            # The native edge's build stage installs a C compiler, which stays there: no layer of the image.
            assert installs == [], f"{target}: {installs}"
            assert "openjdk" not in built_with, target
            continue
        (install,) = installs
        assert "openjdk-17-jre-headless" in install.split()
        assert "--no-install-recommends" in install
        assert "rm -rf /var/lib/apt/lists/*" in install


def test_each_image_installs_exactly_its_programs_pins(dockerfile: Dockerfile, repo_root: Path) -> None:
    for target in TARGETS:
        chain = [s for s in dockerfile.chain(target) if s.name != NATIVE_STAGE]  # maturin's pin: test_native_edge_*
        copied = {w for s in chain for i in s.all("COPY") for w in i.words()[:-1] if w.startswith("requirements/")}
        assert copied == {f"requirements/{target}.txt"}, (target, copied)
        pip = [i.value for s in chain for i in s.all("RUN") if "pip install" in i.value and "-r " in i.value]
        assert len(pip) == 1 and "--no-deps -r" in pip[0], pip  # the lock is the whole set: nothing resolved
        checked = " ".join(i.value for s in chain for i in s.all("RUN"))
        assert "pip check" in checked  # ... and the set is complete
        pinned = lock_names(repo_root / "requirements" / f"{target}.txt")
        assert pinned, target
        assert pinned & NOT_IN[target] == set(), (target, pinned & NOT_IN[target])
    assert {"pyspark", "py4j", "pyarrow"} <= lock_names(repo_root / "requirements" / "reclaim.txt")
    assert {"kopf", "kubernetes"} <= lock_names(repo_root / "requirements" / "operator.txt")


def test_each_image_runs_as_a_numeric_non_root_user(dockerfile: Dockerfile, chart: helm.Chart) -> None:
    security = chart.values["podSecurity"]
    for target in TARGETS:
        stage = dockerfile.stage(target)
        user = stage.last("USER").value
        uid, _, gid = user.partition(":")
        assert uid.isdigit() and gid.isdigit(), f"USER {user}: Kubernetes can only verify runAsNonRoot for numbers"
        assert int(uid) != 0 and int(gid) != 0
        # The user exists in /etc/passwd (the JVM and Hadoop look it up) ...
        created = " ".join(i.value for s in dockerfile.chain(target) for i in s.all("RUN"))
        assert f"useradd --uid {uid} --gid {gid}" in created
        # ... and the chart runs the pods as that same user.
        assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (int(uid), int(gid), int(gid))
        # USER is the last word of the target: nothing after it runs as root.
        keywords = [i.keyword for i in stage.instructions]
        assert not {"RUN", "COPY", "ADD"} & set(keywords[keywords.index("USER") :]), target


def test_entrypoints_commands_and_ports(dockerfile: Dockerfile) -> None:
    commands = {
        "broker": ["lmq_broker", "serve", "--data-dir", "/data"],
        "operator": ["lmq_operator"],
        "reclaim": ["lmq_reclaim", "--help"],
    }
    ports = {"broker": {"8081", "8082", "9100"}, "operator": {"9101", "8080"}, "reclaim": set()}
    for target in TARGETS:
        assert dockerfile.inherited(target, "ENTRYPOINT").exec_form() == ["python", "-m"]
        assert dockerfile.stage(target).last("CMD").exec_form() == commands[target]
        exposed = {port for i in dockerfile.stage(target).all("EXPOSE") for port in i.words()}
        assert exposed == ports[target], target
        env = " ".join(i.value for s in dockerfile.chain(target) for i in s.all("ENV"))
        assert "PATH=/opt/lmq/bin:$PATH" in env  # "python" is the virtualenv's
        assert "PYTHONDONTWRITEBYTECODE=1" in env  # the root filesystem is read-only in the pods


def test_copy_sources_exist_and_are_in_the_build_context(
    dockerfile: Dockerfile, repo_root: Path, dockerignore: DockerIgnore, context_files: set[str]
) -> None:
    stage_names = [s.name for s in dockerfile.stages]
    copies = [(index, i) for index, stage in enumerate(dockerfile.stages) for i in stage.all("COPY")]
    assert copies
    assert "ADD" not in {i.keyword for s in dockerfile.stages for i in s.instructions}
    for index, copy in copies:
        *sources, _destination = copy.words()
        if "from" in copy.flags:
            assert copy.flags["from"] in stage_names[:index], f"line {copy.line}: unknown stage"
            continue
        for source in sources:
            assert (repo_root / source).exists(), f"line {copy.line}: {source} is not in the repository"
            # A directory whose files the allow-list names one by one (native/edge) is copied with just those.
            sent = not dockerignore.excluded(source) or any(f.startswith(f"{source}/") for f in context_files)
            assert sent, f"line {copy.line}: .dockerignore excludes {source}"


def test_build_context_holds_the_sources_and_nothing_else(context_files: set[str], tracked_files: list[str]) -> None:
    sources = {f for f in tracked_files if f.startswith(("broker/", "operator/", "reclaim/", "requirements/"))}
    assert {f for f in sources if f.endswith(".py")}, "no sources found"
    assert sources <= context_files, sorted(sources - context_files)
    top_level = {f.split("/")[0] for f in context_files}
    assert top_level == {"pyproject.toml", "README.md", "broker", "operator", "reclaim", "requirements", "native"}
    # The crate's manifest, lock, maturin's metadata and sources; never its (large) cargo target directory.
    crate = {f for f in tracked_files if f.startswith(f"{NATIVE_CRATE}/")}
    assert {f"{NATIVE_CRATE}/{name}" for name in ("Cargo.toml", "Cargo.lock", "pyproject.toml", "src/lib.rs")} <= crate
    assert {f for f in context_files if f.startswith("native/")} == crate
    assert not [f for f in context_files if "/target/" in f]
    assert not [f for f in context_files if "__pycache__" in f or f.endswith(".pyc") or ".egg-info" in f]


def copy_context(repo_root: Path, context_files: set[str], context: Path) -> Path:
    for name in context_files:
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo_root / name, context / name)
    return context


def test_the_project_builds_from_exactly_the_build_context(
    dockerfile: Dockerfile, repo_root: Path, context_files: set[str], tmp_path: Path
) -> None:
    """What the wheel stage does, on a copy of the context: the wheel every image installs."""
    context = copy_context(repo_root, context_files, tmp_path / "context")
    (build,) = [i.value for i in dockerfile.stage("wheel").all("RUN")]
    assert "pip wheel --no-deps" in build
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-q",
         "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("lmq-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ENTRYPOINT_MODULES:
        path = module.replace(".", "/")
        assert f"{path}/__init__.py" in names or f"{path}.py" in names, module
    for package in ("lmq_broker", "lmq_operator", "lmq_reclaim"):
        assert f"{package}/py.typed" in names
    assert "lmq_broker/protocol/gen/apache/rocketmq/v2/service_pb2.py" in names
    packaged = {n for n in names if n.endswith(".py")}
    expected = {
        f.split("/", 1)[1] for f in context_files if f.endswith(".py") and f.startswith(("broker/", "operator/"))
    }
    assert expected <= packaged, sorted(expected - packaged)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    extras = {
        line.split(":", 1)[1].strip()
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Provides-Extra:")
    }
    assert set(TARGETS) <= extras  # pip install 'lmq[broker]' and the rest


def test_native_edge_is_built_and_installed_in_the_broker_image_only(dockerfile: Dockerfile, repo_root: Path) -> None:
    """The broker's default edge is the native one: without lmq_edge the image's brokers fall back to grpcio."""
    stage = dockerfile.stage(NATIVE_STAGE)
    assert stage.base == dockerfile.args["PYTHON_IMAGE"]  # the interpreter (and ABI) of /opt/lmq
    copied = {(i.flags.get("from"), i.words()[0]) for i in stage.all("COPY")}
    toolchain = {(RUST_STAGE, "/usr/local/rustup"), (RUST_STAGE, "/usr/local/cargo")}
    assert toolchain | {(None, NATIVE_CRATE), (None, "requirements/dev.txt")} <= copied, copied
    runs = [i.value for i in stage.all("RUN")]
    (pin,) = [
        line
        for line in (repo_root / "requirements" / "dev.txt").read_text().splitlines()
        if line.startswith("maturin==")
    ]
    assert [r for r in runs if "pip install" in r] == [
        "python -m pip install \"$(grep -E '^maturin==' /tmp/dev.txt)\""
    ], pin
    (build,) = [r for r in runs if r.startswith("maturin build")]
    words = build.split()
    assert {"--release", "--locked"} <= set(words)
    assert words[words.index("-m") + 1] == f"{NATIVE_CRATE}/Cargo.toml"
    assert words[words.index("-i") + 1] == "python"
    wheels = words[words.index("-o") + 1]
    # The broker's virtualenv installs the wheel and imports the module; the other images never see it.
    venv = dockerfile.stage("broker-venv")
    assert any(i.flags.get("from") == NATIVE_STAGE and i.words()[0] == wheels for i in venv.all("COPY"))
    (install,) = [i.value for i in venv.all("RUN") if "pip install --no-deps /wheels/" in i.value]
    assert f"{wheels}/lmq_edge-*.whl" in install.split()
    smoke = re.search(r'python -c "([^"]*)"', install)
    assert smoke and "lmq_edge" in {m.strip() for m in smoke.group(1).removeprefix("import ").split(",")}, install
    assert install.index("pip install") < install.index("pip check") < install.index(smoke.group(0))
    for target in TARGETS:
        chain = {s.name for s in dockerfile.chain(target)}
        assert (NATIVE_STAGE in chain and RUST_STAGE in chain) == (target == "broker"), (target, chain)


def test_native_edge_wheel_builds_from_exactly_the_build_context(
    dockerfile: Dockerfile, repo_root: Path, context_files: set[str], tmp_path: Path
) -> None:
    """The native stage's maturin build on a copy of the context (cargo's cache kept between runs)."""
    context = copy_context(repo_root, context_files, tmp_path / "context")
    (build,) = [i.value for i in dockerfile.stage(NATIVE_STAGE).all("RUN") if i.value.startswith("maturin build")]
    words = build.split()
    words[words.index("-i") + 1] = sys.executable
    words[words.index("-o") + 1] = str(tmp_path / "dist")
    maturin = shutil.which("maturin", path=str(Path(sys.executable).parent)) or shutil.which("maturin")
    assert maturin, "maturin is not installed (requirements/dev.txt)"
    # the cache `make native` fills (the Makefile's CARGO_TARGET_DIR): the same crate, so a fresh machine builds it once
    cache = os.environ.get("CARGO_TARGET_DIR") or str(Path.home() / ".cache" / "lmq" / "cargo-target")
    env = {**os.environ, "CARGO_TARGET_DIR": cache}
    built = subprocess.run(
        [maturin, *words[1:]], cwd=context, env=env, capture_output=True, text=True, check=False, timeout=1200
    )
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("lmq_edge-*.whl")
    assert "-cp311-abi3-" in wheel.name, wheel.name  # the interpreter of /opt/lmq (3.11) and newer
    assert any(n.startswith("lmq_edge/") and n.endswith(".so") for n in zipfile.ZipFile(wheel).namelist())


def test_entrypoint_modules_start(repo_root: Path) -> None:
    """`python -m <module> --help` works for every module the images and the chart run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo_root / "broker"), str(repo_root / "operator")])}
    # An operator that ignored --help would start kopf: make that fail fast instead of reaching a cluster.
    env["KUBECONFIG"] = os.devnull
    processes = {
        module: subprocess.Popen(
            [sys.executable, "-m", module, "--help"],
            cwd=repo_root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for module in ENTRYPOINT_MODULES
    }
    failures = {}
    for module, process in processes.items():
        try:
            out, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        if process.returncode != 0 or "usage" not in out.lower():
            failures[module] = f"exit {process.returncode}: {(err or out).strip()[-400:]}"
    assert failures == {}, failures


def pod_specs(objects: list[Manifest]) -> Iterator[tuple[str, dict[str, Any]]]:
    for obj in objects:
        if obj["kind"] == "CronJob":
            spec = obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        elif obj["kind"] in ("Deployment", "StatefulSet"):
            spec = obj["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            spec = obj["spec"]
        else:
            continue
        yield obj["metadata"]["labels"]["app.kubernetes.io/component"], spec


def test_chart_runs_each_image_the_way_the_dockerfile_says(
    dockerfile: Dockerfile, render: Render, chart: helm.Chart, repo_root: Path
) -> None:
    project_version = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]["version"]
    assert chart.metadata["appVersion"] == project_version  # the default image tag is the package version
    containers = {
        component: spec["containers"][0] for component, spec in pod_specs(render({"reclaim": {"enabled": True}}))
    }
    assert set(containers) == {"broker", "operator", "reclaim", "test"}
    for component, container in containers.items():
        target = "broker" if component == "test" else component  # the helm test runs a module of the broker image
        assert container["image"] == f"lmq-{target}:{project_version}"
        entrypoint = dockerfile.inherited(target, "ENTRYPOINT").exec_form()
        assert entrypoint is not None
        assert container["command"][:2] == entrypoint
        if component != "test":
            assert container["command"][2] == f"lmq_{component}"
            cmd = dockerfile.stage(target).last("CMD").exec_form()
            assert cmd is not None and cmd[0] == f"lmq_{component}"
        exposed = {p for i in dockerfile.stage(target).all("EXPOSE") for p in i.words()}
        assert {str(p["containerPort"]) for p in container.get("ports", [])} <= exposed, component
    broker = containers["broker"]
    cmd = dockerfile.stage("broker").last("CMD").exec_form()
    assert cmd is not None
    # The chart's broker is the image's default command, with flags added after it.
    assert [*broker["command"][2:], *broker["args"]][: len(cmd)] == cmd
    assert {str(p["containerPort"]) for p in broker["ports"]} == {
        p for i in dockerfile.stage("broker").all("EXPOSE") for p in i.words()
    }
    data_dir = cmd[cmd.index("--data-dir") + 1]
    assert data_dir in {m["mountPath"] for m in broker["volumeMounts"]}
    assert data_dir in {v for i in dockerfile.stage("broker").all("VOLUME") for v in i.words()}
