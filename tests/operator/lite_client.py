"""The official Python client (rocketmq 5.1.2) as a child process of the operator tests, which cannot load it
themselves (it brings its own apache.rocketmq.v2 descriptors, as the broker's do).

    python lite_client.py send <endpoint> <topic> <lite,lite,...> <per-lite>   -> one line: messages sent
    python lite_client.py consume <endpoint> <group> <topic> <lite,...> <count> <timeout_s>
        -> one JSON line per message received: [lite, body]; exit 1 when fewer than count arrived in time
"""

from __future__ import annotations

import json
import sys
import time

from rocketmq import ClientConfiguration, Credentials, LitePushConsumer, Message, Producer

from lmq_broker.testing import Inbox


def _config(endpoint: str) -> ClientConfiguration:
    return ClientConfiguration(endpoint, Credentials(), request_timeout=5)


def send(endpoint: str, topic: str, lites: list[str], per_lite: int) -> int:
    producer = Producer(_config(endpoint), (topic,))
    producer.startup()
    try:
        sent = 0
        for n in range(per_lite):
            for lite in lites:
                message = Message()
                message.topic = topic
                message.lite_topic = lite
                message.body = f"{lite}/{n}".encode()
                producer.send(message)
                sent += 1
        return sent
    finally:
        producer.shutdown()


def consume(endpoint: str, group: str, topic: str, lites: list[str], *, count: int, timeout_s: float) -> int:
    inbox = Inbox()
    consumer = LitePushConsumer(_config(endpoint), group, topic, inbox)
    consumer.startup()
    try:
        for lite in lites:
            consumer.subscribe_lite(lite)
        inbox.wait_for(lambda box: len(box.accepted) >= count, timeout_s)
        time.sleep(2)  # acks of the last messages reach the brokers; duplicates would show up meanwhile
        for message in inbox.accepted:
            print(json.dumps([message.lite_topic, message.body.decode()]), flush=True)
        return 0 if len(inbox.accepted) >= count else 1
    finally:
        consumer.shutdown()


def main(argv: list[str]) -> int:
    verb, *args = argv
    if verb == "send":
        endpoint, topic, lites, per_lite = args
        print(send(endpoint, topic, lites.split(","), int(per_lite)), flush=True)
        return 0
    endpoint, group, topic, lites, count, timeout_s = args
    return consume(endpoint, group, topic, lites.split(","), count=int(count), timeout_s=float(timeout_s))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
