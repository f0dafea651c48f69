"""Who is calling: the ``x-mq-*`` headers every official client sends, and the listener the call came in on.

grpc aio builds a new tuple of the call's headers at every ``context.invocation_metadata()`` (~3 µs in-process,
~10 µs on a loaded host), and builds one anyway to find the call's handler: the v2 service's handler finder
(``guard.Messaging``) keeps that one in ``METADATA``, and ``metadata_of`` reads it from there.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import grpc

from lmq_broker import errors

Metadata = Iterable[tuple[str, str | bytes]]  # a tuple at run time

CLIENT_ID: Final = "x-mq-client-id"
LANGUAGE: Final = "x-mq-language"
CLIENT_VERSION: Final = "x-mq-client-version"
NAMESPACE: Final = "x-mq-namespace"
# On a call a broker of the cluster makes for a client (signed with the admin pair): the client's user, whose
# client id it is (``authorizing.Gate.acting``); read only on calls signed by a super user.
ON_BEHALF: Final = "x-lmq-on-behalf-of"
ON_BEHALF_FROM: Final = "x-lmq-on-behalf-from"  # with it, the client's address (``context.peer()`` where it called)
MAX_CLIENT_ID_CHARS: Final = 512
_WANTED: Final = frozenset((CLIENT_ID, LANGUAGE, CLIENT_VERSION, NAMESPACE))
# The current call's headers, as grpc read them to find its handler (each call runs in a task of its own, so it
# never sees another's).
METADATA: Final[contextvars.ContextVar[Metadata | None]] = contextvars.ContextVar("lmq_metadata", default=None)


def metadata_of(context: grpc.aio.ServicerContext[Any, Any]) -> Metadata:
    """The call's headers: those the handler finder kept (``METADATA``), else read from grpc."""
    found = METADATA.get()
    return found if found is not None else context.invocation_metadata() or ()


@dataclass(frozen=True, slots=True)
class Caller:
    client_id: str = ""
    language: str = ""
    version: str = ""
    namespace: str = ""
    peer: str = ""  # the connection (context.peer()), read only where it matters: Telemetry, termination
    external: bool = False  # came in on the external listener (--external-port): routes name external addresses
    user: str = ""  # under --acl, the user the call acts for (``authorizing.Gate.acting``), named to peers
    source: str = ""  # with it, the client's address, for rules that name networks (a subscription's only)

    @staticmethod
    def of(metadata: Iterable[tuple[str, str | bytes]] | None, peer: str = "", *, external: bool = False) -> Caller:
        headers: dict[str, str] = {}
        for key, value in metadata or ():
            if key in _WANTED and isinstance(value, str):  # gRPC metadata keys arrive lower-cased
                headers[key] = value
        return Caller(
            client_id=headers.get(CLIENT_ID, ""),
            language=headers.get(LANGUAGE, ""),
            version=headers.get(CLIENT_VERSION, ""),
            namespace=headers.get(NAMESPACE, ""),
            peer=peer,
            external=external,
        )

    def require_client_id(self) -> str:
        if not self.client_id:
            raise errors.InvalidArgument(f"header {CLIENT_ID} is required", kind="client_id")
        if len(self.client_id) > MAX_CLIENT_ID_CHARS:
            raise errors.InvalidArgument(f"header {CLIENT_ID} is too long", kind="client_id")
        return self.client_id

    @property
    def splits_lite_topics(self) -> bool:
        """rocketmq-python-client 5.1.2 sends ``subscribe_lite("ab")`` as the set ``{"a", "b"}`` (it extends a
        repeated field with the string itself). Only that exact client gets the workaround."""
        return self.language == "PYTHON" and self.version == "5.1.2"

    @property
    def hides_failed_start(self) -> bool:
        """Clients that cannot say why their start failed when the broker refuses their settings:
        rocketmq-python-client 5.1.2 (its cleanup raises AttributeError, ``None.shutdown()``, and hides the
        cause) and the Java client (it retries the route fetch on the ended session and reports "Stream is
        already completed" or a timeout). Such a client is better told at its first subscription call, which
        it reports with the code."""
        return (self.language == "PYTHON" and self.version == "5.1.2") or self.language == "JAVA"
