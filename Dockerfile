# syntax=docker/dockerfile:1
#
# One image for the three lmq components; the module to run is the first argument:
#
#   docker run IMAGE                                   # broker: lmq_broker serve --data-dir /data (the CMD)
#   docker run IMAGE lmq_broker serve --port 8081 ...  # broker with flags (each also an LMQ_* variable)
#   docker run IMAGE lmq_operator                      # kopf operator (LMQ_OPERATOR_* variables)
#   docker run IMAGE lmq_reclaim --help                # PySpark reclaim job (needs the JRE below)
#
# The Helm chart (charts/lmq) spells the same commands: `python -m <module>` plus arguments.
#
# Both stages use the same base image so the virtualenv built in the first one finds its interpreter at
# the same path in the second. Bookworm, not the newer Debian the bare 3.11-slim tag may point at: it is
# the release that packages OpenJDK 17, the Java PySpark 4 needs.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/lmq
WORKDIR /src
# Dependencies first: this layer is reused until pyproject.toml changes. Installing the project itself
# (a non-editable wheel built from the sources) then only costs a few seconds per code change.
COPY pyproject.toml README.md ./
RUN /opt/lmq/bin/python -c "import tomllib; d = tomllib.load(open('pyproject.toml', 'rb')); print('\n'.join(d['project']['dependencies']))" > /tmp/requirements.txt \
    && /opt/lmq/bin/pip install -r /tmp/requirements.txt
COPY broker ./broker
COPY operator ./operator
RUN /opt/lmq/bin/pip install --no-deps . \
    && /opt/lmq/bin/python -c "import lmq_broker, lmq_operator, lmq_reclaim"

FROM ${PYTHON_IMAGE} AS runtime
# The JRE is for PySpark (the reclaim job); the broker and the operator never start a JVM. The man-page
# directory is missing from slim images and the JRE's post-install script expects it.
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
# A named user (not only a uid): the JVM and Hadoop's user lookup fail for a uid missing from /etc/passwd.
RUN groupadd --gid 10001 lmq \
    && useradd --uid 10001 --gid 10001 --home-dir /home/lmq --create-home --shell /usr/sbin/nologin lmq \
    && mkdir -p /data \
    && chown 10001:10001 /data
COPY --from=builder /opt/lmq /opt/lmq
# No .pyc writes at run time: the root filesystem is read-only in the chart's pods.
ENV PATH=/opt/lmq/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The reclaim job's JVM maps this class-data-sharing archive of Spark's classes (the chart passes
# --class-archive): it halves the JVM's start-up CPU. Made here because it must match this JDK and these jars.
RUN python -m lmq_reclaim.warmup /opt/lmq/reclaim-classes.jsa
WORKDIR /home/lmq
VOLUME ["/data"]
# 8081: gRPC (apache.rocketmq.v2.MessagingService + lmq.admin.v1.LmqAdmin); 9100: /healthz /readyz /metrics.
EXPOSE 8081 9100
# No HEALTHCHECK: one image runs three programs with different endpoints, and Kubernetes ignores it anyway;
# the chart declares each component's probes.
# Numeric, so Kubernetes can verify runAsNonRoot without looking inside the image.
USER 10001:10001
ENTRYPOINT ["python", "-m"]
CMD ["lmq_broker", "serve", "--data-dir", "/data"]
