"""``python -m lmq_operator``: kopf with our settings, metrics and liveness endpoint.

Standalone (no peering): the chart runs one replica, and kopf's peering pauses rather than elects, so a
second replica would add nothing but a stall.
"""

from __future__ import annotations

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


def main() -> int:
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
