"""The cap on persistent MQTT sessions one broker holds (``--mqtt-max-sessions``), below ``host`` so that every
part of a connection may ask it (``limits`` refuses a CONNECT over it)."""

from __future__ import annotations

from lmq_broker.config import BrokerConfig
from lmq_broker.mqtt import durable


class Sessions:
    """Persistent sessions this broker holds (``--mqtt-max-sessions``): the session rows of ``mqtt.sqlite3``
    (``durable.Durable.sessions``: a take-over's merged rows too, and expired ones until dropped) and the new
    ones CONNECTs under way are making."""

    def __init__(self, config: BrokerConfig, rows: durable.Durable) -> None:
        self.max_sessions = config.mqtt_max_sessions
        self._rows = rows
        self._making: set[str] = set()

    def reserve(self, client_id: str) -> bool:
        """Room for a new session of ``client_id``, held until ``made``; False past the cap."""
        if client_id not in self._making:
            if self._rows.sessions + len(self._making) >= self.max_sessions:
                return False
            self._making.add(client_id)
        return True

    def made(self, client_id: str) -> None:
        """Its row is written (it counts among the rows now), or it never will be."""
        self._making.discard(client_id)
