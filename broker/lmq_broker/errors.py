"""One flat taxonomy of broker errors; each carries structured fields.

Mapping to v2 status codes lives in exactly one place: ``lmq_broker.protocol.status``.
"""

from __future__ import annotations


class LmqError(Exception):
    """Base of every error the broker raises on purpose."""

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        self.fields = fields


class InvalidArgument(LmqError):
    """Bad input: missing or malformed field."""


class InvalidName(InvalidArgument):
    """A topic, group or queue name that is not allowed."""


class InvalidLiteTopic(InvalidArgument):
    """A lite topic name that is blank, too long or has characters outside [A-Za-z0-9_-]."""


class BodyEmpty(InvalidArgument):
    pass


class BodyTooLarge(InvalidArgument):
    pass


class RecordTooLarge(InvalidArgument):
    """A record larger than a segment can hold."""


class NotFound(LmqError):
    pass


class TopicNotFound(NotFound):
    pass


class GroupNotFound(NotFound):
    pass


class Conflict(LmqError):
    """The request contradicts existing state (e.g. a group bound to another topic)."""


class LiteTopicQuotaExceeded(LmqError):
    pass


class SubscriptionQuotaExceeded(LmqError):
    pass


class TooManyRequests(LmqError):
    pass


class InvalidReceiptHandle(LmqError):
    pass


class Unauthorized(LmqError):
    pass


class Forbidden(LmqError):
    """An authenticated caller asked for something that is not its own (another client's termination)."""


class Unsupported(LmqError):
    """A valid request for a feature this broker does not implement (e.g. transactional messages)."""


class BrokerUnavailable(LmqError):
    """A broker could not be reached or did not answer in time (raised by clients; worth a retry)."""


class NotEnoughReplicas(BrokerUnavailable):
    """Fewer replicas of the slot than --min-insync-replicas stored a send (docs/replication.md): try again."""


class Fenced(BrokerUnavailable):
    """This broker does not hold (or can no longer be sure it holds) the Lease of the slot: it acknowledges
    nothing of it (docs/replication.md)."""


class StorageError(LmqError):
    """The store cannot serve (I/O failure, corrupted data beyond repair)."""


class CorruptRecord(StorageError):
    """A record whose CRC or framing does not check."""


class IndexCorrupt(StorageError):
    """RocksDB found a damaged file of the index (a cache of the log: it is rebuilt)."""


class UnsupportedVersion(StorageError):
    """A record header version this build does not understand."""
