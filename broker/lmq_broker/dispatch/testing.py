"""Test harness for the dispatch layer: a dispatcher on a manual clock over any store, with a LITE parent
``P`` and a lite group ``G``, and helpers to send and receive. Used by the broker test suite and benches."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from lmq_broker import model
from lmq_broker.config import BrokerConfig, FlushMode, StoreConfig
from lmq_broker.dispatch import filters
from lmq_broker.dispatch.dispatcher import Delivery, Dispatcher
from lmq_broker.storage.api import Store
from lmq_broker.storage.memory import ManualClock

PARENT = "P"
GROUP = "G"


def config_for(data_dir: Path, **overrides: object) -> BrokerConfig:
    """A broker config with an async-flushed store in ``data_dir`` (tests need no fsync per message)."""
    store = StoreConfig(data_dir=data_dir, flush_mode=FlushMode.ASYNC)
    return BrokerConfig.model_validate({"store": store, **overrides})


def lite_message(
    lite: str, body: bytes = b"x", *, parent: str = PARENT, message_id: str = "m", tag: str | None = None
) -> model.NewMessage:
    return model.NewMessage(
        message_id=message_id,
        topic=parent,
        body=body,
        queues=(model.QueueId(parent, 0), model.QueueId.lmq(parent, lite)),
        lite_topic=lite,
        message_type=model.MessageType.LITE,
        tag=tag,
    )


@dataclass
class Lite:
    dispatcher: Dispatcher
    store: Store
    clock: ManualClock
    ids: itertools.count[int] = field(default_factory=itertools.count)

    @staticmethod
    async def start(store: Store, clock: ManualClock, config: BrokerConfig) -> Lite:
        store.put_parent_topic(model.ParentTopic(PARENT))
        store.put_group(model.LiteGroup(GROUP, PARENT, retry=model.RetryPolicy(max_attempts=3, backoff_ms=(1000,))))
        dispatcher = Dispatcher(store, config, clock=clock)
        await dispatcher.start()
        return Lite(dispatcher, store, clock)

    async def send(
        self, lite: str, body: bytes = b"x", parent: str = PARENT, *, tag: str | None = None
    ) -> model.AppendResult:
        message = lite_message(lite, body, parent=parent, message_id=f"id-{next(self.ids)}", tag=tag)
        (result,) = await self.dispatcher.send([message])
        return result

    async def receive(
        self,
        client: str,
        batch: int = 32,
        invisible_ms: int = 10_000,
        poll_ms: int = 0,
        *,
        auto_renew: bool = False,
        tags: filters.TagFilter = filters.ALL,
    ) -> list[Delivery]:
        return await self.dispatcher.receive_lite(
            client, GROUP, PARENT, batch=batch, invisible_ms=invisible_ms, poll_ms=poll_ms, auto_renew=auto_renew,
            tags=tags,
        )  # fmt: skip

    async def drain(self, client: str, want: int, group: str = GROUP) -> list[str]:
        """Receive and ack as ``client`` of ``group`` until ``want`` deliveries came; their lite topics. Between
        tries the manual clock moves a catch-up delay on, so passes a full ready queue put off run."""
        got: list[str] = []
        for _ in range(300):
            for d in await self.dispatcher.receive_lite(
                client, group, PARENT, batch=32, invisible_ms=10_000, poll_ms=0
            ):
                got.append(d.message.lite_topic or "")
                await self.dispatcher.ack(group, d.receipt_handle)
            if len(got) >= want:
                return got
            await asyncio.sleep(0.005)
            self.clock.advance(self.dispatcher.ready.catchup_delay_ms)
            self.dispatcher.tick()
        raise AssertionError(f"{got} after waiting for {want}")

    def committed(self, lite: str, group: str = GROUP) -> int | None:
        return self.store.get_offset(model.QueueId.lmq(PARENT, lite), group)

    def put_group(self, group: model.LiteGroup) -> None:
        self.store.put_group(group)
        self.dispatcher.metadata_changed()


async def until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    """Poll ``condition`` on the loop until it holds; fail after ``timeout_s`` of real time."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.001)


async def background_done(dispatcher: Dispatcher, timeout_s: float = 5) -> None:
    """Let the dispatcher's background tasks (catch-up passes, commit retries) finish."""
    await until(lambda: not dispatcher.runtime.tasks, timeout_s)
