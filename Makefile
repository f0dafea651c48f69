# The two commands of the README: `make run` and `make test`. Everything they need is installed here, at the
# versions pinned in requirements/ (`make lock`): `make run` only what the broker needs (requirements/broker.txt:
# no PySpark, no Kubernetes client), `make test` and the rest everything (requirements/dev.txt).
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.lmq-installed
BROKER_STAMP := $(VENV)/.lmq-broker-installed
DATA   ?= ./data
PORT   ?= 8081

.PHONY: run test check test-fast torture lint types imports proto proto-check crds crds-check lock lock-check testenv \
	clients mqtt-clients bench hooks clean

$(STAMP): pyproject.toml requirements/dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' -c requirements/dev.txt
	touch $(STAMP)

$(BROKER_STAMP): pyproject.toml requirements/broker.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[broker]' -c requirements/broker.txt
	touch $(BROKER_STAMP)

run: $(BROKER_STAMP)
	$(BIN)/python -m lmq_broker serve --data-dir $(DATA) --port $(PORT)

# Lint, types, import layers, then every suite. The official RocketMQ client ships its own copy of the
# apache.rocketmq.v2 descriptors, so suites that import it run in their own interpreter (tests/e2e).
test: $(STAMP) lint types imports proto-check crds-check lock-check testenv clients mqtt-clients
	$(BIN)/python -m pytest tests --ignore=tests/e2e
	$(BIN)/python -m pytest tests/e2e

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
# (`make test` runs one); LMQ_CLUSTER_FAULT_ROUNDS to vary.
torture: $(STAMP) clients
	LMQ_TORTURE_CYCLES=$${LMQ_TORTURE_CYCLES:-110} $(BIN)/python -m pytest -s tests/e2e/test_torture.py
	LMQ_CLUSTER_FAULT_ROUNDS=$${LMQ_CLUSTER_FAULT_ROUNDS:-20} LMQ_CLUSTER_FAULT_STAGGER_S=$${LMQ_CLUSTER_FAULT_STAGGER_S:-10} \
		$(BIN)/python -m pytest -s tests/e2e/test_cluster_faults.py
	LMQ_CLUSTER_FAULT_ROUNDS=$${LMQ_CLUSTER_FAULT_ROUNDS:-20} $(BIN)/python -m pytest -s tests/clients/test_cluster_faults_java.py
	$(BIN)/python -m pytest -s tests/mqtt/test_limits.py tests/mqtt/test_durable_wills.py tests/mqtt/test_swallowed_errors.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

types: $(STAMP)
	$(BIN)/mypy broker operator tests bench scripts

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

# The official-client drivers (Java, Go, Node) of tests/clients, built once per source hash outside the repo.
clients: $(STAMP)
	bash scripts/clients-build.sh

# Debian's mosquitto-clients (mosquitto_pub/mosquitto_sub) for the MQTT suites; they fail, never skip, without.
mqtt-clients:
	bash scripts/mqtt-clients-install.sh

bench: $(STAMP)
	@for b in bench/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
