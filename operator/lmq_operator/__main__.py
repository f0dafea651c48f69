"""``python -m lmq_operator``: kopf with our settings, metrics and liveness endpoint.

Standalone (no peering): the chart runs one replica, and kopf's peering pauses rather than elects, so a
second replica would add nothing but a stall.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import kopf
import prometheus_client

from lmq_operator import handlers, settings


def _quiet_resync(record: logging.LogRecord) -> bool:
    """Drop the per-tick success lines of resync timers (one per resource per interval); keep the rest."""
    return not (
        record.levelno <= logging.INFO and str(record.msg).startswith("Timer ") and "succeeded" in str(record.msg)
    )


_ENVIRONMENT = """\
environment (all optional unless noted):
  LMQ_OPERATOR_BROKERS              static broker admin endpoints host:port,... (or the next three)
  LMQ_OPERATOR_BROKER_SERVICE       headless Service of the broker StatefulSet (EndpointSlice discovery)
  LMQ_OPERATOR_BROKER_NAMESPACE     namespace of that Service/StatefulSet (required with it)
  LMQ_OPERATOR_BROKER_STATEFULSET   broker StatefulSet, to detect scale-down of brokers holding data
  LMQ_OPERATOR_BROKER_PORT          admin port of discovered brokers when their Service names none (default 8081)
  LMQ_OPERATOR_NAMESPACE            watch one namespace instead of the whole cluster
  LMQ_OPERATOR_METRICS_PORT         Prometheus /metrics port (default 9101, -1 disables)
  LMQ_OPERATOR_LIVENESS_ENDPOINT    kopf liveness endpoint (default http://0.0.0.0:8080/healthz)
  LMQ_OPERATOR_ACCESS_KEY / _SECRET_KEY  the brokers' admin key pair (needed unless they run --admin-anonymous)
  LMQ_TLS_CA                        PEM CA of the brokers' certificate: admin calls over TLS (default plaintext)
  LMQ_TLS_SERVER_NAME               the name that certificate must carry (default: the host dialled)
  LMQ_OPERATOR_RESYNC_SECONDS, _DISCOVERY_SECONDS, _ADMIN_TIMEOUT_SECONDS, _RETRY_SECONDS  timings
"""


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m lmq_operator",
        description="Reconciles ParentTopic, LiteGroup and LiteQuota resources into every lmq broker.",
        epilog=_ENVIRONMENT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    ).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kopf.objects").addFilter(_quiet_resync)
    try:
        conf = settings.from_env(os.environ)
    except settings.SettingsError as exc:
        print(f"lmq-operator: {exc}", file=sys.stderr)
        return 2
    if conf.metrics_port >= 0:
        prometheus_client.start_http_server(conf.metrics_port)
    assert handlers.configure is not None  # registers the handlers by importing the module
    kopf.run(
        standalone=True,
        clusterwide=conf.namespace is None,
        namespaces=[conf.namespace] if conf.namespace else (),
        liveness_endpoint=conf.liveness_endpoint,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
