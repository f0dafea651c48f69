"""Driver for the official Python client (rocketmq-python-client), steered by JSON lines (../README.md).

Runs in the venv's interpreter as its own process: the official client carries its own copy of the
apache.rocketmq.v2 descriptors, which cannot share an interpreter with the broker's.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

from rocketmq import (
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    LitePushConsumer,
    LiteSimpleConsumer,
    Message,
    Producer,
    PushConsumer,
    SimpleConsumer,
)

# The client logs through `logging`; a stray print must never corrupt the protocol, so the JSON lines go
# to a private copy of the real stdout and sys.stdout points at stderr.
_out = os.fdopen(os.dup(1), "w", buffering=1)
sys.stdout = sys.stderr
_write_lock = threading.Lock()
SETTINGS_WAIT_S = 10.0


def emit(obj: dict[str, Any]) -> None:
    line = json.dumps(obj)
    with _write_lock:
        _out.write(line + "\n")


def message_json(m: Any) -> dict[str, Any]:
    return {
        "topic": m.topic,
        "lite_topic": m.lite_topic or None,
        "message_id": m.message_id,
        "body": base64.b64encode(m.body).decode(),
        "tag": m.tag or None,
        "keys": sorted(m.keys or ()),
        "properties": dict(m.properties or {}),
        "attempt": m.delivery_attempt,
    }


class Listener:
    """Records every delivery as an event; FAILURE for the first ``fail_times`` deliveries of a message."""

    def __init__(self, name: str, fail_times: int) -> None:
        self.name, self.fail_times = name, fail_times
        self.deliveries: Counter[str] = Counter()
        self.lock = threading.Lock()

    def consume(self, message: Any) -> ConsumeResult:
        with self.lock:
            self.deliveries[message.message_id] += 1
            seen = self.deliveries[message.message_id]
        emit({"event": "message", "consumer": self.name, **message_json(message)})
        return ConsumeResult.FAILURE if seen <= self.fail_times else ConsumeResult.SUCCESS


class Driver:
    def __init__(self, endpoint: str) -> None:
        self.config = ClientConfiguration(endpoint, Credentials(), request_timeout=5)
        self.clients: dict[str, Any] = {}
        self.handles: dict[str, tuple[str, Any]] = {}
        self.handle_ids = itertools.count()

    def client(self, name: str) -> Any:
        if name not in self.clients:
            raise KeyError(f"no client named {name!r}")
        return self.clients[name]

    def start(self, name: str, client: Any) -> dict[str, Any]:
        client.startup()
        self.clients[name] = client
        return {}

    # --- ops ----------------------------------------------------------------------------------------------
    def op_producer(self, name: str, topics: list[str]) -> dict[str, Any]:
        return self.start(name, Producer(self.config, tuple(topics)))

    def op_send(
        self,
        *,
        producer: str,
        topic: str,
        body: str,
        lite_topic: str | None = None,
        tag: str | None = None,
        keys: list[str] | None = None,
        message_group: str | None = None,
        properties: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        m = Message()
        m.topic = topic
        m.body = base64.b64decode(body)
        if lite_topic is not None:
            m.lite_topic = lite_topic
        if tag is not None:
            m.tag = tag
        for key in keys or ():
            m.keys = key  # the 5.1.2 setter adds one key per assignment
        if message_group is not None:
            m.message_group = message_group
        for key, value in (properties or {}).items():
            m.add_property(key, value)
        return {"message_id": self.client(producer).send(m).message_id}

    def op_lite_push(self, name: str, group: str, topic: str, fail_times: int = 0) -> dict[str, Any]:
        return self.start(name, LitePushConsumer(self.config, group, topic, Listener(name, fail_times)))

    def op_push(self, name: str, group: str, topic: str, expression: str = "*", fail_times: int = 0) -> dict[str, Any]:
        subscription = {topic: FilterExpression(expression)}
        return self.start(name, PushConsumer(self.config, group, Listener(name, fail_times), subscription))

    def op_subscribe_lite(self, consumer: str, lite_topic: str) -> dict[str, Any]:
        self.client(consumer).subscribe_lite(lite_topic)
        return {}

    def op_unsubscribe_lite(self, consumer: str, lite_topic: str) -> dict[str, Any]:
        self.client(consumer).unsubscribe_lite(lite_topic)
        return {}

    def op_subscribe_lite_all(self, consumer: str) -> dict[str, Any]:
        self.client(consumer).subscribe_lite_all()
        return {}

    def op_lite_topics(self, consumer: str) -> dict[str, Any]:
        c = self.client(consumer)
        # 5.1.2 has no public accessor for the local set; it lives in the subscription manager.
        kind = "LitePushConsumer" if isinstance(c, LitePushConsumer) else "LiteSimpleConsumer"
        manager = getattr(c, f"_{kind}__subscription_manager")
        return {"lite_topics": sorted(manager._LiteTopicSubscriptionManager__lite_topics)}

    def op_simple(self, name: str, group: str, topic: str, expression: str = "*", await_s: float = 5) -> dict[str, Any]:
        subscription = {topic: FilterExpression(expression)}
        return self.start(name, SimpleConsumer(self.config, group, subscription, await_duration=await_s))

    def op_lite_simple(self, name: str, group: str, topic: str, await_s: float = 5) -> dict[str, Any]:
        self.start(name, LiteSimpleConsumer(topic, self.config, group, await_duration=await_s))
        # 5.1.2's LiteSimpleConsumer starts without waiting for the broker's settings, and its subscription
        # quota reads 0 until they arrive (subscribe_lite fails with 42902 "exceed quota: 0" meanwhile).
        manager = self.clients[name]._LiteSimpleConsumer__subscription_manager
        quota = manager._LiteTopicSubscriptionManager__lite_subscription_quota
        deadline = time.monotonic() + SETTINGS_WAIT_S
        while quota.get() <= 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no settings for {name} within {SETTINGS_WAIT_S} s")
            time.sleep(0.05)
        return {}

    def op_lite_simple_subscribe(self, consumer: str, lite_topic: str) -> dict[str, Any]:
        return self.op_subscribe_lite(consumer, lite_topic)

    def op_receive(self, consumer: str, max: int, invisible_s: int) -> dict[str, Any]:
        out = []
        for m in self.client(consumer).receive(max, invisible_s):
            handle = str(next(self.handle_ids))
            self.handles[handle] = (consumer, m)
            out.append({**message_json(m), "handle": handle})
        return {"messages": out}

    def op_ack(self, consumer: str, handle: str) -> dict[str, Any]:
        owner, message = self.handles.pop(handle)
        if owner != consumer:
            raise KeyError(f"handle {handle} belongs to {owner}")
        self.client(consumer).ack(message)
        return {}

    def op_shutdown(self, name: str) -> dict[str, Any]:
        self.clients.pop(name).shutdown()
        return {}

    def shutdown_all(self) -> None:
        for name in list(self.clients):
            try:
                self.clients.pop(name).shutdown()
            except Exception:  # best effort at exit; the error is logged
                traceback.print_exc()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    driver = Driver(parser.parse_args().endpoint)
    emit({"event": "ready"})
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        rid, op = request.pop("id"), request.pop("op")
        if op == "exit":
            driver.shutdown_all()
            emit({"id": rid, "ok": True})
            return 0
        try:
            result = getattr(driver, f"op_{op}")(**request)
            emit({"id": rid, "ok": True, **result})
        except Exception as exc:  # every failure is reported to the scenario
            traceback.print_exc()
            emit({"id": rid, "ok": False, "error": f"{type(exc).__name__}: {exc}", "code": getattr(exc, "code", None)})
    driver.shutdown_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
