"""What a connection needs of the listener that accepted it, as a Protocol: connections (and ``storing``)
depend on this seam, not on ``server.MqttServer``, so the server imports the connection code and nothing imports
the server back (an import-linter contract keeps it so)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from lmq_broker.access.control import AccessControl
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch import wildcards
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.mqtt import durable, following, framing, session_cap, shares, stats, topics, wills
from lmq_broker.mqtt.owners import Owners


class Client(Protocol):
    """What the host sees of a connection: whose it is, and how to end it."""

    @property
    def client_id(self) -> str: ...

    @property
    def peer(self) -> str: ...

    @property
    def done(self) -> asyncio.Event: ...  # set once the connection has ended

    async def kick(self) -> None: ...

    async def recheck(self) -> bool: ...  # access control changed: end the filters no longer allowed (row written?)

    def close(self, code: int, why: str = "") -> None: ...


class Host(Protocol):
    """The MQTT listener, as its connections use it."""

    dispatcher: Dispatcher
    config: BrokerConfig
    owners: Owners | None  # a cluster's (None: alone)
    durable: durable.Durable
    stats: stats.Stats
    read_budget: framing.Budget
    sessions: session_cap.Sessions  # persistent sessions held, against --mqtt-max-sessions
    share_members: shares.Members  # the members of each shared subscription connected here
    wills: wills.Wills
    followers: following.Followers  # sessions whose filters reach into parents created later
    stopping: bool
    access: AccessControl  # users and policies (--acl): ``authorizing``

    async def take_over(self, connection: Client, clean_start: bool) -> None: ...

    async def rows_saved(self, client_id: str, what: str) -> None:
        """Rows of ``mqtt.sqlite3`` just changed (``what``: a persistent session, its QoS 2 packet ids, retained
        messages) for ``client_id``: returns once they are on the replicas (``--replicas``), before its answer."""

    def authorize_publish(self, user: str, address: str, where: topics.Topic) -> None: ...  # Forbidden (--acl)

    def authorize_subscribe(self, user: str, address: str, parent: str, levels: wildcards.Filter) -> None: ...

    def owner(self, client_id: str) -> Client | None: ...

    def forget(self, connection: Client) -> None: ...
