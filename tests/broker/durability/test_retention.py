"""A serving broker applies retention on its own: old closed segments go, the queues' first offsets advance."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import prometheus_client
import pytest
from waiting import eventually_async

from lmq_broker import app, model
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.testing import config_for, lite_message
from lmq_broker.storage import api

pytestmark = pytest.mark.asyncio


def retention_config(data: Path, max_age_ms: int) -> BrokerConfig:
    cfg = config_for(data, host="127.0.0.1", port=0, metrics_port=0)
    store = cfg.store.model_copy(
        update={"segment_max_bytes": 4096, "retention_max_age_ms": max_age_ms, "retention_interval_ms": 100}
    )
    return cfg.model_copy(update={"store": store})


async def fill(broker: app.Broker, count: int) -> model.QueueId:
    assert broker.store is not None and broker.dispatcher is not None
    messages = [lite_message("old", b"x" * 1000, parent=app.BOOTSTRAP_TOPIC, message_id=f"m{i}") for i in range(count)]
    await broker.dispatcher.send(messages)  # ~20 records of 1 KiB over 4 KiB segments: several close
    return model.QueueId.lmq(app.BOOTSTRAP_TOPIC, "old")


def retention_counter(broker: app.Broker) -> float:
    value = broker.metrics.registry.get_sample_value("lmq_retention_segments_deleted_total")
    return value or 0.0


async def test_a_serving_broker_drops_expired_segments_on_its_interval(tmp_path: Path) -> None:
    broker = app.Broker(retention_config(tmp_path / "data", max_age_ms=0))
    await broker.start()
    try:
        assert broker.store is not None
        queue = await fill(broker, 20)
        store = broker.store
        await eventually_async(lambda: store.queue_offsets(queue)[0] > 0, "retention ran")
        low, high = store.queue_offsets(queue)
        assert 0 < low < high == 20  # the active segment (the newest records) stays
        assert store.read(queue, low, 100)[0].offset == low
        # Counted when the pass ends: queue minimums advance segment by segment while it runs.
        await eventually_async(lambda: retention_counter(broker) >= 1, "the retention pass counted")
        exposition = prometheus_client.generate_latest(broker.metrics.registry).decode()
        assert "lmq_retention_bytes_deleted_total" in exposition
    finally:
        await broker.stop(grace_s=0.2)


async def test_nothing_is_dropped_before_its_age(tmp_path: Path) -> None:
    broker = app.Broker(retention_config(tmp_path / "data", max_age_ms=3_600_000))
    await broker.start()
    try:
        store = broker.store
        assert store is not None
        passes: list[api.RetentionReport] = []
        apply = store.apply_retention

        def counted(stop: Callable[[], bool] | None = None) -> api.RetentionReport:
            passes.append(apply(stop))
            return passes[-1]

        store.apply_retention = counted  # type: ignore[method-assign]
        queue = await fill(broker, 20)
        await eventually_async(lambda: len(passes) >= 3, "three retention passes")
        assert store.queue_offsets(queue) == (0, 20)
        assert retention_counter(broker) == 0 and not any(p.segments_deleted for p in passes)
    finally:
        await broker.stop(grace_s=0.2)
