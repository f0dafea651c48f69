# The two commands of the README: `make run` and `make test`. Everything they need is installed here, at the
# versions pinned in requirements/ (`make lock`): `make run` only what the broker needs (requirements/broker.txt:
# no PySpark, no Kubernetes client), `make test` and the rest everything (requirements/dev.txt).
# Python 3.11, 3.12 or 3.13 (the first found; `make run PYTHON=python3.13` to choose). A venv made by another
# Python than $(PYTHON) is made again, not left failing until `make clean`.
PYTHON ?= $(firstword $(shell command -v python3.11 python3.12 python3.13 2>/dev/null) python3.11)
PYVER  := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
VENV   ?= .venv
BIN    := $(VENV)/bin
PYMARK := $(VENV)/.python-$(PYVER)
STAMP  := $(VENV)/.lmq-installed
BROKER_STAMP := $(VENV)/.lmq-broker-installed
NATIVE_STAMP := $(VENV)/.lmq-native-installed
# The native edge's Rust build (make native): cargo's target directory outside the repository, so a rebuild after
# a Python-only change is a no-op and one after a Rust change incremental (cold: 3.5 min on 2 cores, ~5 with TLS).
CARGO_TARGET_DIR ?= $(HOME)/.cache/lmq/cargo-target
NATIVE_SOURCES := native/edge/Cargo.toml native/edge/Cargo.lock native/edge/pyproject.toml $(wildcard native/edge/src/*.rs)
# The other supported Pythons `make test` also runs the broker's suites on (test-pythons), each found on PATH
# or in pyenv; a version this machine lacks is named and passed over.
OTHER_PYTHONS ?= 3.12 3.13
DATA   ?= ./data
PORT   ?= 8081
METRICS_PORT ?= 9100

.PHONY: native native-if-cargo test-pythons test-grpcio-edge run test check test-fast torture lint types imports proto proto-check crds crds-check lock lock-check testenv \
	clients mqtt-clients bench hooks clean

$(PYMARK):
	@test -n "$(PYVER)" || { echo "no Python 3.11-3.13 found (PYTHON=$(PYTHON)): install one, or set PYTHON"; exit 1; }
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	touch $(PYMARK)

$(STAMP): $(PYMARK) pyproject.toml requirements/dev.txt
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' -c requirements/dev.txt
	touch $(STAMP)

$(BROKER_STAMP): $(PYMARK) pyproject.toml requirements/broker.txt
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[broker]' -c requirements/broker.txt
	touch $(BROKER_STAMP)

# The native gRPC edge (serve --edge native, docs/design/native-edge.md): the Rust crate native/edge built by maturin
# (pinned in requirements/dev.txt) into a wheel installed in the venv. Rust (cargo) from rustup; crates from
# crates.io through cargo, Cargo.lock committed.
native: $(NATIVE_STAMP)

$(NATIVE_STAMP): $(PYMARK) requirements/dev.txt $(NATIVE_SOURCES)
	@command -v cargo >/dev/null || { echo "make native: cargo not found: install Rust (https://rustup.rs)"; exit 1; }
	$(BIN)/python -m pip install -q "$$(grep -E '^maturin==' requirements/dev.txt)"
	rm -rf $(VENV)/.native-wheels
	CARGO_TARGET_DIR=$(CARGO_TARGET_DIR) $(BIN)/maturin build --release --quiet -m native/edge/Cargo.toml \
		-i $(BIN)/python -o $(VENV)/.native-wheels
	$(BIN)/python -m pip install -q --force-reinstall --no-deps $(VENV)/.native-wheels/lmq_edge-*.whl
	touch $(NATIVE_STAMP)

# `make run` serves on the native edge, the default; a machine without Rust still runs the broker: `serve` falls
# back to grpcio's edge and logs why (said here too, not failed).
native-if-cargo: $(PYMARK)
	@if command -v cargo >/dev/null; then $(MAKE) --no-print-directory native; \
	else echo "cargo not found: the native edge (the default) is not built, so serve falls back to grpcio's edge;" \
		"install Rust and run make native"; fi

run: $(BROKER_STAMP) native-if-cargo
	$(BIN)/python -m lmq_broker serve --data-dir $(DATA) --port $(PORT) --metrics-port $(METRICS_PORT)

# Lint, types, import layers, then every suite. The official RocketMQ client ships its own copy of the
# apache.rocketmq.v2 descriptors, so suites that import it run in their own interpreter (tests/e2e).
# Each phase prints its time (scripts/timed.sh), and the run ends with all of them.
TIMED := scripts/timed.sh
export LMQ_PHASES := $(VENV)/.phase-times
test: $(STAMP) lock-check native
	@rm -f $(VENV)/.phase-times
	@$(TIMED) lint $(MAKE) --no-print-directory lint
	@$(TIMED) types $(MAKE) --no-print-directory types
	@$(TIMED) imports $(MAKE) --no-print-directory imports
	@$(TIMED) "proto and CRD checks" $(MAKE) --no-print-directory proto-check crds-check
	@$(TIMED) "apiserver + etcd (built once, cached)" $(MAKE) --no-print-directory testenv
	@$(TIMED) "official clients (built once, cached)" $(MAKE) --no-print-directory clients
	@$(TIMED) "MQTT clients" $(MAKE) --no-print-directory mqtt-clients
	@$(TIMED) "tests: all but e2e" $(BIN)/python -m pytest $(XDIST) tests --ignore=tests/e2e
	@$(TIMED) "tests: e2e" $(BIN)/python -m pytest tests/e2e
	@$(TIMED) "tests: clients on grpcio's edge" $(MAKE) --no-print-directory test-grpcio-edge
	@$(TIMED) "tests: other Pythons" $(MAKE) --no-print-directory test-pythons
	@$(TIMED) --summary

# grpcio's edge (`serve --edge grpcio`: selectable, and what `serve` falls back to where lmq_edge is not built) under
# the official clients, since every other phase runs on the native edge, the default: the Python client's and the
# MQTT suites of tests/e2e and tests/clients (Java, Go, Node and Python drivers; not its fault loop), each broker
# they start on grpcio's edge (LMQ_EDGE). About 5 min. The cases parametrized on both edges (TLS and renewal, the
# caps, LitePush, the access port of --processes, compressed requests, metrics) run in the phases above.
GRPCIO_EDGE_E2E := $(addprefix tests/e2e/,test_quickstart.py test_normal_and_a2a.py test_lite_patterns.py \
	test_lite_ttl.py test_tag_filters.py test_wire_compat.py test_acl.py test_security.py test_mqtt.py test_mqtt_topics.py)
GRPCIO_EDGE_CLIENTS := tests/clients --ignore=tests/clients/test_cluster_faults_java.py
test-grpcio-edge: $(STAMP)
	LMQ_EDGE=grpcio $(BIN)/python -m pytest $(GRPCIO_EDGE_E2E)
	LMQ_EDGE=grpcio $(BIN)/python -m pytest $(XDIST) $(GRPCIO_EDGE_CLIENTS)

# The suites but e2e on pytest-xdist workers: most tests wait on brokers, clients and JVMs, so 3 workers pay on
# 2 cores. Each worker takes a whole module (and a slow test alone), the longest first: tests/conftest.py.
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)

# The broker extra on every other supported Python this machine has: its own venv (.venv-3.X, pinned by
# requirements/broker.txt and dev.txt), the storage suite and the broker suite's unit tier, and a real broker
# process served and stopped (tests/broker/cli/test_cli.py), on the native edge (its abi3 wheel, `make native`).
PY_SUITES := tests/storage tests/broker/cli/test_cli.py
# Broker tests that need the operator's test apiserver (lmq_operator.testing, the operator extra) or the MQTT test
# client (paho, a dev dependency): not importable in the broker-only venvs, and not unit tests anyway; found by
# what they import, so a new one is too
PY_NOT_BROKER_ONLY := $(patsubst %,--ignore=%,$(shell grep -l "kube_testing\|lmq_operator\|import yaml\|testing_mqtt\|import paho" tests/broker/*/*.py))
test-pythons: native
	@for v in $(OTHER_PYTHONS); do \
	  py=; for c in $$(ls -d $$HOME/.pyenv/versions/$$v*/bin/python$$v 2>/dev/null | tail -1) $$(command -v python$$v); do \
	    if $$c -c 'import sys' 2>/dev/null; then py=$$c; break; fi; \
	  done; \
	  if [ -z "$$py" ]; then echo "test-pythons: no python$$v on this machine: not tested on it"; continue; fi; \
	  venv=.venv-$$v; \
	  if [ ! -f $$venv/.lmq-installed ] || [ pyproject.toml -nt $$venv/.lmq-installed ] || \
	     [ requirements/broker.txt -nt $$venv/.lmq-installed ] || ! $$venv/bin/python -c 'import xdist' 2>/dev/null; then \
	    echo "test-pythons: $$venv from $$py"; rm -rf $$venv && $$py -m venv $$venv && \
	    $$venv/bin/python -m pip install -q --upgrade pip && \
	    $$venv/bin/python -m pip install -q -e '.[broker]' -c requirements/broker.txt && \
	    $$venv/bin/python -m pip install -q pytest pytest-asyncio pytest-timeout pytest-xdist hypothesis psutil \
	      -c requirements/dev.txt && touch $$venv/.lmq-installed || exit 1; \
	  fi; \
	  $$venv/bin/python -m pip install -q --force-reinstall --no-deps $(VENV)/.native-wheels/lmq_edge-*.whl || exit 1; \
	  echo "test-pythons: Python $$v"; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider $(XDIST) $(PY_SUITES) || exit 1; \
	  $$venv/bin/python -m pytest -q -p no:cacheprovider $(XDIST) -m "unit and not slow" tests/broker $(PY_NOT_BROKER_ONLY) || exit 1; \
	done

# The daily loop. `check`: lint, types, import layers and the unit tier (in-process, no socket, child process or
# real waiting; tests/conftest.py lists it), in under a minute. `test-fast`: every suite that needs no
# apiserver, Spark or other client processes (a few minutes). Tiers are markers: -m kube / spark / e2e / slow.
check: $(STAMP) lint types imports
	$(BIN)/python -m pytest -q -m "unit and not slow" tests --ignore=tests/e2e

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not (kube or spark or e2e or slow)" tests --ignore=tests/e2e

# git hooks (pre-commit, from .pre-commit-config.yaml): ruff, formatting, mypy and import layers before a commit
hooks: $(STAMP)
	$(BIN)/pre-commit install

# The long fault-injection loop (kill -9 / SIGTERM under load, flipped bytes, torn tails, missing segments,
# damaged index tables); `make test` runs 10 cycles of it. LMQ_TORTURE_CYCLES / LMQ_TORTURE_SEED to vary. Then the
# cluster-fault suites (issue 25: Python + MQTT, `--processes 2` pods, the Java client), 20 kill -9 rounds each
# (`make test` runs one); LMQ_CLUSTER_FAULT_ROUNDS to vary. Then the storage faults on real filesystems (issue 26:
# full index/, meta/ and commitlog/, failing fsyncs in both flush modes; as root, for the loop devices). Then the
# replication chaos loop (issue 32: R=2 on the real apiserver, kill -9 of a random slot owner under load, its disk
# deleted every other round; `make test` runs 2 rounds); LMQ_REPLICATION_CHAOS_ROUNDS / _SEED to vary.
torture: $(STAMP) clients
	LMQ_TORTURE_CYCLES=$${LMQ_TORTURE_CYCLES:-110} $(BIN)/python -m pytest -s tests/e2e/test_torture.py
	LMQ_CLUSTER_FAULT_ROUNDS=$${LMQ_CLUSTER_FAULT_ROUNDS:-20} LMQ_CLUSTER_FAULT_STAGGER_S=$${LMQ_CLUSTER_FAULT_STAGGER_S:-10} \
		$(BIN)/python -m pytest -s tests/e2e/test_cluster_faults.py
	LMQ_CLUSTER_FAULT_ROUNDS=$${LMQ_CLUSTER_FAULT_ROUNDS:-20} $(BIN)/python -m pytest -s tests/clients/test_cluster_faults_java.py
	$(BIN)/python -m pytest -s tests/storage/test_full_disk.py  # full index/meta/log disks, failing fsyncs (root: loop devices)
	$(BIN)/python -m pytest -s tests/mqtt/test_limits.py tests/mqtt/test_durable_wills.py tests/mqtt/test_swallowed_errors.py
	$(BIN)/python -m pytest -s tests/broker/protocol/test_parked_caps.py tests/broker/dispatch/test_metadata_reload.py \
		tests/admin/test_with_broker.py tests/broker/dispatch/test_dispatcher.py -k "cap or flood or refused or reload or fresh or gone"
	LMQ_REPLICATION_CHAOS_ROUNDS=$${LMQ_REPLICATION_CHAOS_ROUNDS:-20} $(BIN)/python -m pytest -s \
		tests/broker/replication/test_replication_chaos.py

lint: $(STAMP)
	@bad=$$(git ls-files | grep -E '[[:space:]:|]' || true); \
	if [ -n "$$bad" ]; then echo "file names with spaces, ':' or '|' (a shell accident?): $$bad"; exit 1; fi
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy broker operator reclaim tests bench scripts

imports: $(STAMP)
	$(BIN)/lint-imports

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

proto-check: $(STAMP)
	$(BIN)/python scripts/gen_proto.py --check

# The CRDs (crds/, the chart's copy) and the field tables of docs/operator.md, from the operator's models.
crds: $(STAMP)
	$(BIN)/python scripts/gen_crds.py

crds-check: $(STAMP)
	$(BIN)/python scripts/gen_crds.py --check

# requirements/<program>.txt from pyproject.toml's extras (uv pip compile, every platform, Python 3.11); pins
# move only when pyproject.toml needs them to (`$(BIN)/python scripts/lock.py --upgrade` moves them all).
# lock-check fails when pyproject.toml changed without `make lock` (it reads the package index).
lock: $(STAMP)
	$(BIN)/python scripts/lock.py

lock-check: $(STAMP)
	$(BIN)/python scripts/lock.py --check

# Real kube-apiserver + etcd for the operator suite, built from Go modules and cached outside the repo.
testenv:
	bash scripts/testenv-build.sh

# The official-client drivers (Java, Go, Node) of tests/clients and the Eclipse Paho Java MQTT scenarios
# (tests/clients/mqtt-java), built once per source hash outside the repo; no JDK or Maven fails here.
clients: $(STAMP)
	bash scripts/clients-build.sh

# Debian's mosquitto-clients (mosquitto_pub/mosquitto_sub) for the MQTT suites; they fail, never skip, without.
mqtt-clients:
	bash scripts/mqtt-clients-install.sh

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-3.* build *.egg-info  # the native edge's cargo cache stays: $(CARGO_TARGET_DIR)
