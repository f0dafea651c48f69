"""What every handler needs: the dispatcher, the config, this broker's advertised endpoint, metrics."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from lmq_broker.access.control import AccessControl
from lmq_broker.config import BrokerConfig
from lmq_broker.dispatch.dispatcher import Dispatcher
from lmq_broker.protocol import convert, parking
from lmq_broker.protocol.calls import ClusterCalls
from lmq_broker.protocol.connections import Connections
from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.metrics import Metrics


@dataclass
class Edge:
    dispatcher: Dispatcher
    config: BrokerConfig
    port: int = 0  # the bound port, set once the server listens
    metrics: Metrics = field(default_factory=Metrics)
    connections: Connections = field(default_factory=Connections)  # whose Telemetry runs on which peer
    cluster: ClusterCalls | None = None  # in a cluster (docs/scale-out.md; set by cluster.setup); None: alone
    external_port: int = 0  # the external listener's bound port (--external-port), 0 without one
    external_address: str = ""  # this lone broker's external host:port (cluster.external), empty: none given
    access: AccessControl = field(default_factory=lambda: AccessControl(False))  # users and policies (--acl)
    send_cache: convert.SendCache = field(default_factory=convert.SendCache)  # valid names the send path met
    polls: parking.Parking = field(init=False)  # ReceiveMessage long polls parked, by client id and connection
    streams: parking.Parking = field(init=False)  # Telemetry streams open, by client id and connection
    telemetry_buffer: parking.Budget = field(init=False)  # bytes of Telemetry replies not yet read, in all

    def __post_init__(self) -> None:
        config = self.config
        self.polls = parking.Parking(
            "long polls", config.max_polls_per_client, config.max_polls_per_connection, config.max_polls
        )
        self.streams = parking.Parking(
            "Telemetry streams", config.max_telemetry_streams_per_client, config.max_telemetry_streams_per_connection
        )
        self.telemetry_buffer = parking.Budget(config.telemetry_buffer_bytes)

    def endpoints(self, requested: pb.Endpoints | None = None, *, external: bool = False) -> pb.Endpoints:
        """Where clients should call this broker: the configured advertised host, else the address the
        client itself used to reach us (one broker answers its own route), else this host's name. On the
        external listener: its configured external address, else the address the client used."""
        if external:
            if self.external_address:
                return convert.endpoints_of_address(self.external_address)
        elif self.config.advertised_host:
            return convert.endpoints_of(self.config.advertised_host, self.port)
        port = self.external_port if external else self.port
        if (
            requested is not None
            and requested.scheme != pb.ADDRESS_SCHEME_UNSPECIFIED
            and requested.addresses
            and (requested.scheme != pb.DOMAIN_NAME or len(requested.addresses) == 1)
        ):
            return requested
        return convert.endpoints_of(socket.gethostname(), port)

    def broker(self, requested: pb.Endpoints | None = None, *, external: bool = False) -> pb.Broker:
        return pb.Broker(name=self.config.broker_name, id=0, endpoints=self.endpoints(requested, external=external))

    def brokers(
        self, requested: pb.Endpoints | None = None, *, external: bool = False, lite_route: bool = False
    ) -> list[tuple[pb.Broker, int]]:
        """The brokers a route lists, each with its queues' permission: this one alone, or every broker of the
        cluster, this one first and the others in slot order (leaving ones READ; ``cluster.calls``)."""
        if self.cluster is not None:
            return list(self.cluster.brokers(external=external, lite_route=lite_route))
        return [(self.broker(requested, external=external), pb.READ_WRITE)]

    @property
    def store_host(self) -> str:
        return self.config.advertised_host or socket.gethostname()
