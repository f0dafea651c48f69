# syntax=docker/dockerfile:1
#
# One image per program, each with only what that program needs (the broker carries no Spark and no JVM):
#
#   docker build --target broker   -t lmq-broker:0.1.0 .    # gRPC (the native edge), RocksDB, Prometheus client
#   docker build --target operator -t lmq-operator:0.1.0 .  # kopf and the Kubernetes client
#   docker build --target reclaim  -t lmq-reclaim:0.1.0 .   # PySpark and the Java 17 runtime it starts
#
# `docker build .` builds the broker (the last stage). Every image runs `python -m <module>`:
#
#   docker run lmq-broker:0.1.0                               # lmq_broker serve --data-dir /data (the CMD)
#   docker run lmq-broker:0.1.0 lmq_broker serve --port 8081 ...   # with flags (each also an LMQ_* variable)
#   docker run lmq-operator:0.1.0                             # lmq_operator (LMQ_OPERATOR_* variables)
#   docker run lmq-reclaim:0.1.0 lmq_reclaim --broker-service ...
#
# The Helm chart (charts/lmq) spells the same commands, with the image of each component.
#
# Every program installs the versions pinned in requirements/<program>.txt (`make lock`), then the project's
# wheel without dependencies (the broker also the native edge's wheel, built in a stage of its own). All stages
# but the Rust toolchain's use the same base image so a virtualenv built in one finds its interpreter at the
# same path in another. Bookworm, not the newer Debian the bare 3.11-slim tag may point at:
# it is the release that packages OpenJDK 17, the Java PySpark 4 needs.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The Rust toolchain of the native edge's build stage only (no image ships it); bookworm like the Python base.
ARG RUST_IMAGE=rust:1.95-slim-bookworm

# The project's wheel, built once for every program (only this layer is rebuilt after a code change).
FROM ${PYTHON_IMAGE} AS wheel
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY broker ./broker
COPY operator ./operator
COPY reclaim ./reclaim
RUN python -m pip wheel --no-deps --wheel-dir /wheels .

# The native gRPC edge (lmq_edge, native/edge; docs/design/native-edge.md), the broker's default edge: its
# wheel is built on the Python base, with the interpreter /opt/lmq's virtualenv is made from, and the Rust
# toolchain copied from the official image. Only the broker's virtualenv installs it; the compiler stays here.
FROM ${RUST_IMAGE} AS rust
FROM ${PYTHON_IMAGE} AS native-edge
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RUSTUP_HOME=/usr/local/rustup \
    CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:$PATH
# rustc links through cc, and ring compiles its C and assembly with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=rust /usr/local/rustup /usr/local/rustup
COPY --from=rust /usr/local/cargo /usr/local/cargo
COPY requirements/dev.txt /tmp/dev.txt
RUN python -m pip install "$(grep -E '^maturin==' /tmp/dev.txt)"
WORKDIR /src
COPY native/edge ./native/edge
RUN maturin build --release --locked -m native/edge/Cargo.toml -i python -o /native-wheels

# One virtualenv per program: its pinned dependencies first (a layer reused until the lock file changes),
# then the wheel, then an import of its entry module as a smoke test of the two together.
FROM ${PYTHON_IMAGE} AS broker-venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements/broker.txt /tmp/requirements.txt
RUN python -m venv /opt/lmq \
    && /opt/lmq/bin/pip install --no-deps -r /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
COPY --from=native-edge /native-wheels /native-wheels
RUN /opt/lmq/bin/pip install --no-deps /wheels/*.whl /native-wheels/lmq_edge-*.whl \
    && /opt/lmq/bin/pip check \
    && /opt/lmq/bin/python -c "import lmq_broker.__main__, lmq_broker.admin.cli, lmq_broker.roundtrip, lmq_edge"

FROM ${PYTHON_IMAGE} AS operator-venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements/operator.txt /tmp/requirements.txt
RUN python -m venv /opt/lmq \
    && /opt/lmq/bin/pip install --no-deps -r /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN /opt/lmq/bin/pip install --no-deps /wheels/*.whl \
    && /opt/lmq/bin/pip check \
    && /opt/lmq/bin/python -c "import lmq_operator.__main__"

FROM ${PYTHON_IMAGE} AS reclaim-venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements/reclaim.txt /tmp/requirements.txt
RUN python -m venv /opt/lmq \
    && /opt/lmq/bin/pip install --no-deps -r /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN /opt/lmq/bin/pip install --no-deps /wheels/*.whl \
    && /opt/lmq/bin/pip check \
    && /opt/lmq/bin/python -c "import lmq_reclaim.__main__, lmq_reclaim.warmup"

# What the three images share: the user, the environment, the entrypoint.
FROM ${PYTHON_IMAGE} AS runtime
# A named user (not only a uid): the JVM and Hadoop's user lookup fail for a uid missing from /etc/passwd.
RUN groupadd --gid 10001 lmq \
    && useradd --uid 10001 --gid 10001 --home-dir /home/lmq --create-home --shell /usr/sbin/nologin lmq
# No .pyc writes at run time: the root filesystem is read-only in the chart's pods.
ENV PATH=/opt/lmq/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/lmq
ENTRYPOINT ["python", "-m"]
# No HEALTHCHECK: Kubernetes ignores it; the chart declares each component's probes.

FROM runtime AS operator
COPY --from=operator-venv /opt/lmq /opt/lmq
# 9101: /metrics; 8080: kopf's liveness endpoint.
EXPOSE 9101 8080
# Numeric, so Kubernetes can verify runAsNonRoot without looking inside the image.
USER 10001:10001
CMD ["lmq_operator"]

FROM runtime AS reclaim
# The JRE PySpark starts. The man-page directory is missing from slim images and the JRE's post-install
# script expects it.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
COPY --from=reclaim-venv /opt/lmq /opt/lmq
# The job's JVM maps this class-data-sharing archive of Spark's classes (the chart passes --class-archive): it
# halves the JVM's start-up CPU. Made here because it must match this JDK and these jars.
RUN python -m lmq_reclaim.warmup /opt/lmq/reclaim-classes.jsa
USER 10001:10001
CMD ["lmq_reclaim", "--help"]

FROM runtime AS broker
RUN mkdir -p /data \
    && chown 10001:10001 /data
COPY --from=broker-venv /opt/lmq /opt/lmq
VOLUME ["/data"]
# 8081: gRPC apache.rocketmq.v2.MessagingService (and lmq.admin.v1 unless --admin-port); 8082: lmq.admin.v1
# where the chart puts it (--admin-port 8082); 9100: /healthz /readyz /metrics.
EXPOSE 8081 8082 9100
USER 10001:10001
CMD ["lmq_broker", "serve", "--data-dir", "/data"]
