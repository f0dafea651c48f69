"""Fixtures of the e2e suite: the official rocketmq-python-client 5.1.2 against a broker subprocess.

This suite runs in its own interpreter (the official client carries its own apache.rocketmq.v2
descriptors), so it reaches the broker only over the wire: v2 through the client, admin through
``AdminClient`` (which loads no v2 descriptors).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, start_broker

_names = itertools.count()


@pytest.fixture(scope="module")
def edge() -> str:
    """The server of the broker's client port (``serve --edge``); empty: the broker's own choice (``LMQ_EDGE``
    in the environment, else the native edge), so ``LMQ_EDGE=grpcio pytest tests/e2e`` runs every suite on
    grpcio's edge (``make test-grpcio-edge``). A module overrides this fixture with parameters to run its cases
    on each edge (test_lite_push.py)."""
    return ""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory, edge: str) -> Iterator[BrokerProcess]:
    process = start_broker(tmp_path_factory.mktemp("e2e") / "data", extra_args=("--edge", edge) if edge else ())
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def admin(broker: BrokerProcess) -> Iterator[AdminClient]:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as client:
        yield client


@pytest.fixture
def unique() -> Callable[[str], str]:
    """Fresh resource names, so tests can share a module's broker."""
    return lambda prefix: f"{prefix}-{next(_names)}"


@pytest.fixture
def lite_group(admin: AdminClient, unique: Callable[[str], str]) -> Callable[..., tuple[str, str]]:
    """Create a LITE parent topic and a lite group bound to it; returns (topic, group)."""

    def create(**group_fields: Any) -> tuple[str, str]:
        topic, group = unique("T"), unique("G")
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(group, topic, **group_fields))
        return topic, group

    return create


log = logging.getLogger(__name__)
CLIENT_SHUTDOWN_S: Final = 30.0


@pytest.fixture
def clients() -> Iterator[list[Any]]:
    """Started official clients to shut down at the end of the test (producers, consumers).

    Each shutdown gets ``CLIENT_SHUTDOWN_S``. The official Python client's shutdown joins its consumption
    threads, and once (a fresh-clone run, after a test that had passed) one of them had stopped but never gave up
    its thread state, so the join hung until pytest-timeout failed the teardown. A shutdown that does not
    finish in time is logged (WARNING) and left behind on its daemon thread: it is the client library's
    own teardown, after every assertion about what the broker did."""
    started: list[Any] = []
    yield started
    for client in reversed(started):
        stopping = threading.Thread(target=client.shutdown, name=f"shutdown-{type(client).__name__}", daemon=True)
        stopping.start()
        stopping.join(CLIENT_SHUTDOWN_S)
        if stopping.is_alive():
            log.warning("%s.shutdown() did not finish in %g s: left behind", type(client).__name__, CLIENT_SHUTDOWN_S)


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


_exit_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Ends the interpreter when an official client left threads that would keep it from exiting.

    A push consumer whose broker is gone can keep a consumption thread retrying its ack forever (seen in a
    fresh-clone run: 85 passed, then the interpreter's exit joined that thread pool's worker and never returned).
    Every test's outcome is decided and reported by now, so the run ends with its own exit status; the threads
    left are logged. Daemon threads count too: a client left running keeps its heartbeat timer (a daemon) handing
    calls to thread pools whose workers start later and are not daemons (another fresh-clone run: 93 passed,
    then heartbeats to a stopped pod's ports for minutes, no exit). Without such threads the interpreter exits
    as usual."""
    stuck = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if not stuck or not _exit_status:
        return
    names = ", ".join(sorted({t.name for t in stuck}))
    print(f"\ne2e: {len(stuck)} client thread(s) still running at exit ({names}); ending the run", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(_exit_status[-1])
