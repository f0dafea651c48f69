"""Fixtures of the official-client suite: a real broker process and one driver process per language.

The drivers are built by ``scripts/clients-build.sh`` (``make clients``); their start commands are in
``build/clients/<lang>.json``. A missing driver fails the test that needs it: CI must never skip a client.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest
from testing_clients import LANGS, Driver, DriverMissing, driver_argv, start_driver

from lmq_broker import model
from lmq_broker.admin.client import AdminClient
from lmq_broker.testing import BrokerProcess, start_broker

ROOT: Final = Path(__file__).resolve().parents[2]
POINTERS: Final = ROOT / "build" / "clients"
_names = itertools.count()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    # 5 s long polls (RocketMQ's lower bound) instead of 20 s: the Java client's close waits for its
    # pending receive to return, which would add 20 s to every test's teardown.
    process = start_broker(
        tmp_path_factory.mktemp("clients") / "data", extra_args=["--long-polling-timeout-ms", "5000"]
    )
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def admin(broker: BrokerProcess) -> Iterator[AdminClient]:
    with AdminClient(broker.admin_endpoint, timeout_s=10, **broker.admin_keys) as client:
        yield client


@pytest.fixture(params=LANGS)
def lang(request: pytest.FixtureRequest) -> str:
    value: str = request.param
    return value


@pytest.fixture
def drivers(broker: BrokerProcess, tmp_path: Path) -> Iterator[Callable[[str], Driver]]:
    """Start drivers on demand (a test may need two processes of one language); all closed at the end."""
    started: list[Driver] = []

    def start(lang: str) -> Driver:
        try:
            argv = driver_argv(POINTERS, lang)
        except DriverMissing as missing:
            pytest.fail(str(missing))
        driver = start_driver(argv, lang, broker.endpoint, tmp_path)
        started.append(driver)
        return driver

    yield start
    codes = {d.lang: d.close() for d in reversed(started)}
    noise = [line for d in started for line in d.noise]
    assert not noise, f"drivers printed non-JSON lines to stdout: {noise[:5]}"
    assert all(code == 0 for code in codes.values()), codes


@pytest.fixture
def unique() -> Callable[[str], str]:
    return lambda prefix: f"{prefix}-{next(_names)}"


@pytest.fixture
def lite_group(admin: AdminClient, unique: Callable[[str], str]) -> Callable[..., tuple[str, str]]:
    """A LITE parent topic and a lite group bound to it: (topic, group)."""

    def create(**group_fields: Any) -> tuple[str, str]:
        topic, group = unique("LT"), unique("LG")
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.LITE))
        admin.put_group(model.LiteGroup(group, topic, **group_fields))
        return topic, group

    return create


@pytest.fixture
def normal_topic(admin: AdminClient, unique: Callable[[str], str]) -> Callable[[], str]:
    def create() -> str:
        topic = unique("NT")
        admin.put_parent_topic(model.ParentTopic(topic, model.MessageType.NORMAL, queue_count=4))
        return topic

    return create
