"""In-process brokers with MQTT on, formed into one cluster by ``--peers`` (the MQTT cluster suites)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmq_broker import app, model
from lmq_broker.dispatch import testing as dispatch_testing
from lmq_broker.storage import store as lmq_store
from lmq_broker.supervisor import free_ports


async def start_brokers(tmp_path: Path, parent: str, each: Sequence[dict[str, object]]) -> list[app.Broker]:
    """One broker per item of ``each`` (with those settings), all holding the LITE parent ``parent``."""
    ports = free_ports("127.0.0.1", len(each))
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    brokers = []
    for slot, port in enumerate(ports):
        config = dispatch_testing.config_for(
            tmp_path / f"b{slot}", host="127.0.0.1", port=port, metrics_port=-1, mqtt_port=0, peers=members,
            ordinal=slot, admin_access_key="admin-ak", admin_secret_key="admin-sk", **each[slot],
        )  # fmt: skip
        store = lmq_store.open_store(config.store)
        store.put_parent_topic(model.ParentTopic(parent, model.MessageType.LITE))
        broker = app.Broker(config, store=store)
        await broker.start()
        brokers.append(broker)
    return brokers


async def stop_brokers(brokers: Sequence[app.Broker]) -> None:
    for broker in brokers:
        if broker.ready:
            await broker.stop(grace_s=0.2)
