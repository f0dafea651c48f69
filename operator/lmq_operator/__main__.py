"""``python -m lmq_operator``: kopf with our settings, metrics and liveness endpoint.

kopf runs standalone (its peering pauses operators of equal priority rather than electing one). With
``LMQ_OPERATOR_LEASE_NAME`` set, replicas elect a leader on a Lease first (``leadership``): only the leader
runs kopf; a standby answers its liveness probe and waits. A leader that cannot renew its Lease stops
reconciling and exits, so that its pod restarts as a standby.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

import aiohttp.web
import kopf
import prometheus_client

from lmq_operator import handlers, kube, leadership, metrics, settings

log = logging.getLogger("lmq_operator")


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
  LMQ_OPERATOR_BROKER_MEMBERSHIP    be the brokers' membership source: this ConfigMap records it, and the
                                    StatefulSet is scaled to its lmq.io/replicas annotation (draining first)
  LMQ_OPERATOR_BROKER_ADDRESS       each pod's advertised endpoint: {pod}.<domain>:<port>, or host:port,...
  LMQ_OPERATOR_BROKER_PROCESSES     broker processes per pod (default 1); LMQ_OPERATOR_SCALING_SECONDS (5)
  LMQ_OPERATOR_NAMESPACE            watch one namespace instead of the whole cluster
  LMQ_OPERATOR_METRICS_PORT         Prometheus /metrics port (default 9101, -1 disables)
  LMQ_OPERATOR_LIVENESS_ENDPOINT    kopf liveness endpoint (default http://0.0.0.0:8080/healthz)
  LMQ_OPERATOR_ACCESS_KEY / _SECRET_KEY  the brokers' admin key pair (needed unless they run --admin-anonymous)
  LMQ_TLS_CA                        PEM CA of the brokers' certificate: admin calls over TLS (default plaintext)
  LMQ_TLS_SERVER_NAME               the name that certificate must carry (default: the host dialled)
  LMQ_OPERATOR_RESYNC_SECONDS, _DISCOVERY_SECONDS, _ADMIN_TIMEOUT_SECONDS, _RETRY_SECONDS  timings
  LMQ_OPERATOR_WORKERS              reconciles at once (default 100, 0: no bound)
  LMQ_OPERATOR_LEASE_NAME           elect a leader on this coordination.k8s.io Lease (unset: no election,
                                    run one replica only)
  LMQ_OPERATOR_LEASE_NAMESPACE      namespace of that Lease (required with it)
  LMQ_OPERATOR_LEASE_DURATION_SECONDS, _LEASE_RENEW_DEADLINE_SECONDS, _LEASE_RETRY_SECONDS  15, 10, 2
  LMQ_OPERATOR_POD_NAME             this replica's identity in the Lease and in Events (default: host name)
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
    return asyncio.run(_run(conf))


async def _run(conf: settings.Settings) -> int:
    options: dict[str, Any] = {
        "standalone": True,
        "clusterwide": conf.namespace is None,
        "namespaces": [conf.namespace] if conf.namespace else (),
        "liveness_endpoint": conf.liveness_endpoint,
    }
    if conf.lease is None:
        metrics.LEADER.set(1)
        await kopf.operator(**options)
        return 0
    leases = kube.KubeLeases(conf.lease.name, conf.lease.namespace, timeout_s=conf.lease.retry_s)
    elector = leadership.Elector(leases, conf.lease, monotonic=time.monotonic, wall=lambda: datetime.now(UTC))
    try:
        if not await _elected(elector, conf.liveness_endpoint):
            return 0  # stopped while standing by
        return await _lead(elector, conf.lease, options)
    finally:
        leases.close()


async def _elected(elector: leadership.Elector, liveness: str | None) -> bool:
    """Stand by until we hold the Lease (True) or are told to stop (False)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with _standby_liveness(liveness):
            acquiring, stopping = asyncio.create_task(elector.acquire()), asyncio.create_task(stop.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            for task in (acquiring, stopping):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if stop.is_set():
                await elector.release()  # in case the last attempt did take it
                return False
            return True
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)  # kopf installs its own


async def _lead(elector: leadership.Elector, lease: leadership.LeaseConfig, options: dict[str, Any]) -> int:
    """Run kopf while the Lease is ours. Losing it stops kopf; should kopf not be done before another replica
    may take the Lease over (lease duration minus renew deadline), the process exits there and then."""
    lost = asyncio.Event()

    def on_lost(task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            lost.set()
            _exit_soon(lease)

    holding = asyncio.create_task(elector.hold())
    holding.add_done_callback(on_lost)
    metrics.LEADER.set(1)
    try:
        await kopf.operator(**options, stop_flag=lost)
    finally:
        metrics.LEADER.set(0)
        holding.cancel()
    if lost.is_set():
        return 1  # restarted by Kubernetes, as a standby
    await elector.release()
    return 0


def _exit_soon(lease: leadership.LeaseConfig) -> None:
    grace_s = max(0.5, lease.duration_s - lease.renew_deadline_s - 1.0)

    def hard_exit() -> None:
        log.error("leader election: still running %.1f s after losing the lease: exiting now", grace_s)
        logging.shutdown()
        os._exit(1)

    asyncio.get_running_loop().call_later(grace_s, hard_exit)


@contextlib.asynccontextmanager
async def _standby_liveness(endpoint: str | None) -> AsyncIterator[None]:
    """While standing by, the liveness endpoint kopf would serve answers as kopf's does; kopf takes the
    port over once we lead."""
    if endpoint is None:
        yield
        return
    url = urlsplit(endpoint)

    async def alive(_: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"standby": True})

    app = aiohttp.web.Application()
    app.router.add_get(url.path or "/", alive)
    runner = aiohttp.web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, url.hostname, url.port or 80).start()
    try:
        yield
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    sys.exit(main())
