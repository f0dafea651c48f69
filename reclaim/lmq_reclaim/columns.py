"""Column names and schemas of the frames the job moves, in one place.

Arrow schemas are what the executor-side functions build and read; the Spark DDL strings are the same
shapes as ``mapInArrow`` wants them. Keeping both here means a renamed column breaks loudly in one file.
"""

from __future__ import annotations

import enum
from typing import Final

import pyarrow as pa

BROKER: Final = "broker"
PARENT: Final = "parent"
LITE: Final = "lite"
CREATED_MS: Final = "created_ms"
LAST_STORE_MS: Final = "last_store_ms"
LAST_CONSUME_MS: Final = "last_consume_ms"
MIN_OFFSET: Final = "min_offset"
MAX_OFFSET: Final = "max_offset"
SUBSCRIBER_COUNT: Final = "subscriber_count"
FULLY_CONSUMED: Final = "fully_consumed"

EXPIRATION_MINUTES: Final = "expiration_minutes"
IDLE_MS: Final = "idle_ms"
VERDICT: Final = "verdict"
REASON: Final = "reason"

OUTCOME: Final = "outcome"
ERROR: Final = "error"

SCANNED: Final = pa.schema(
    [
        pa.field(BROKER, pa.string(), nullable=False),
        pa.field(PARENT, pa.string(), nullable=False),
        pa.field(LITE, pa.string(), nullable=False),
        pa.field(CREATED_MS, pa.int64(), nullable=False),
        pa.field(LAST_STORE_MS, pa.int64(), nullable=False),
        pa.field(LAST_CONSUME_MS, pa.int64(), nullable=False),
        pa.field(MIN_OFFSET, pa.int64(), nullable=False),
        pa.field(MAX_OFFSET, pa.int64(), nullable=False),
        pa.field(SUBSCRIBER_COUNT, pa.int32(), nullable=False),
        pa.field(FULLY_CONSUMED, pa.bool_()),  # null when the scan did not ask for it
    ]
)
SCANNED_DDL: Final = (
    f"{BROKER} string not null, {PARENT} string not null, {LITE} string not null, "
    f"{CREATED_MS} long not null, {LAST_STORE_MS} long not null, {LAST_CONSUME_MS} long not null, "
    f"{MIN_OFFSET} long not null, {MAX_OFFSET} long not null, {SUBSCRIBER_COUNT} int not null, "
    f"{FULLY_CONSUMED} boolean"
)

POLICY_DDL: Final = f"{BROKER} string, {PARENT} string, {EXPIRATION_MINUTES} int"

# What the delete step needs per row, and what it reports back (the audit is a projection of this, plus the
# reason, derived again from idle time and expiration).
CANDIDATE_COLUMNS: Final = (
    BROKER,
    PARENT,
    LITE,
    LAST_STORE_MS,
    LAST_CONSUME_MS,
    MAX_OFFSET,
    SUBSCRIBER_COUNT,
    IDLE_MS,
    EXPIRATION_MINUTES,
)
OUTCOMES: Final = pa.schema(
    [
        pa.field(BROKER, pa.string()),
        pa.field(PARENT, pa.string()),
        pa.field(LITE, pa.string()),
        pa.field(LAST_STORE_MS, pa.int64()),
        pa.field(LAST_CONSUME_MS, pa.int64()),
        pa.field(MAX_OFFSET, pa.int64()),
        pa.field(SUBSCRIBER_COUNT, pa.int32()),
        pa.field(IDLE_MS, pa.int64()),
        pa.field(EXPIRATION_MINUTES, pa.int32()),
        pa.field(OUTCOME, pa.string()),
        pa.field(ERROR, pa.string()),
    ]
)
OUTCOMES_DDL: Final = (
    f"{BROKER} string, {PARENT} string, {LITE} string, {LAST_STORE_MS} long, {LAST_CONSUME_MS} long, "
    f"{MAX_OFFSET} long, {SUBSCRIBER_COUNT} int, {IDLE_MS} long, {EXPIRATION_MINUTES} int, "
    f"{OUTCOME} string, {ERROR} string"
)


class Verdict(enum.StrEnum):
    """Values of the ``verdict`` column: why a scanned topic is (not) a candidate, first rule that applies."""

    NO_POLICY = "no-policy"  # the broker does not know the parent (yet): never guess
    NEVER = "never-expires"  # parent expiration -1
    FRESH = "fresh"  # idle for no longer than the parent's expiration
    BELOW_MIN_AGE = "below-min-age"  # idle longer than expiration but shorter than --min-age-minutes
    NOT_FULLY_CONSUMED = "not-fully-consumed"  # --only-fully-consumed
    SUBSCRIBED = "subscribed"  # --no-live-subscribers
    EXPIRED = "expired"


class Outcome(enum.StrEnum):
    """Values of the ``outcome`` column: the broker's DeleteOutcome names, plus ERROR for a failed call."""

    DELETED = "DELETED"
    KEPT_CHANGED = "KEPT_CHANGED"
    KEPT_SUBSCRIBED = "KEPT_SUBSCRIBED"
    NOT_FOUND = "NOT_FOUND"
    WOULD_DELETE = "WOULD_DELETE"
    ERROR = "ERROR"
