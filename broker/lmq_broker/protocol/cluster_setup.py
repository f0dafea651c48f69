"""Builds this broker's ``Peers`` from its config (``--peers``, ``--ordinal``/``--advertised-address``)."""

from __future__ import annotations

import logging

from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.protocol.metrics import Metrics
from lmq_broker.protocol.peers import Peers, membership_of
from lmq_broker.storage.api import Store

log = logging.getLogger(__name__)


def peers(
    config: BrokerConfig, store: Store, dispatcher: Dispatcher, admin_keys: tuple[str, str] | None, metrics: Metrics
) -> Peers | None:
    """None for a broker alone: no peers configured, or a ring of one slot."""
    found = membership_of(config)
    if found is None:
        return None
    membership, me = found
    if len(membership.members) == 1:
        return None

    async def holds_locally(parent: str, lite: str) -> bool:
        return await dispatcher.run(store.lite_topic, parent, lite) is not None

    log.info(
        "slot %d of %d (ring of %d, epoch %d): %s",
        me,
        len(membership.members),
        membership.size,
        membership.epoch,
        ", ".join(membership.members),
    )
    return Peers(membership, me, config, holds_locally=holds_locally, admin_keys=admin_keys, registry=metrics.registry)
