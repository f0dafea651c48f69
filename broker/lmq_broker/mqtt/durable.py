"""What MQTT keeps beyond the store's messages and offsets: persistent sessions' subscriptions, retained
messages and the wills waiting for their delay, in ``<data_dir>/mqtt.sqlite3``.

A session row holds its filters (filter -> subscription options, whose low bits are the granted QoS), its
expiry interval (NULL: never, as a 3.1.1 persistent session under a max expiry of never), when its last
connection ended (NULL while connected): it has expired once ``gone_ms + expiry_s * 1000`` has passed (the
interval at most ``max_expiry_s``, ``--mqtt-max-session-expiry-s``: a row written as "never", NULL, by an older
version or another broker, expires then too), and its owner: the user name of the CONNECT that made it (NULL
in a file older than owners; under ``--acl`` only its owner resumes it, see ``handshake.open_session``).
Columns added after the first release are added to an older file when it is opened.

A qos2 row is a persistent session's QoS 2 packet id in flight (MQTT 3.1.1 and 5.0 section 4.3.3, 4.4):
inbound, a publish stored and answered PUBREC whose PUBREL has not come (a resend of it is not stored
again, also after a restart); outbound, a delivery the client answered PUBREC, PUBREL sent, whose PUBCOMP has
not come (a reconnect resends the PUBREL, not the PUBLISH), with its message id ("" for a retained message):
the message handed out again after a restart is settled, not sent twice; published, a delivery written to
the client whose PUBREC has not come, with its message id: handed out again after a reconnect or a restart, it
is sent under the same packet id with DUP (MQTT-4.4.0-1), so a client that had it does not take it as a new
message; a QoS 1 delivery has one too (written before it, with its batch's, not fsynced: ``qos2_promise``).
resend, a retained message sent at QoS 1 or 2 and not yet acknowledged (no PUBACK, no PUBREC), written before
it is, with all it takes to send it again (``Unacked``): a resumed session gets it again after the CONNACK,
under its packet id with DUP. Dropped with the session.

An armed row is the will of a live connection, written at its CONNECT and deleted at its end: a broker killed
meanwhile finds it at its restart and makes it a waiting will (``fire_armed``): MQTT-3.1.2-8.

A will row is written when its connection ends and deleted once published or cancelled (its client id came
back): a delayed will survives a restart and costs no memory while it waits (``wills``).

All three are small, keyed, overwritten in place and read by key or key range (a subscriber reads the
retained messages a page of keys at a time and each payload alone, ``retained_keys``), which is not what an
append-only commit log is for (a retained message must outlive the log's retention; a session's filter set is replaced
whole). SQLite in WAL mode with ``synchronous=FULL`` makes each write durable before it returns, so a PUBACK
or SUBACK sent after it never promises more than the disk holds; the rows that need only outlive a killed
process (a QoS 1 or retained delivery's packet id, a live connection's will) are written with
``synchronous=NORMAL``: in the WAL once the call returns, not fsynced (a power cut may lose the last ones).
Calls block: the broker runs them on a worker thread, serialised by one lock (SQLite connections are not
shared across threads otherwise).
"""

from __future__ import annotations

import base64
import contextlib
import json
import sqlite3
import threading
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

FILE_NAME: Final = "mqtt.sqlite3"
_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS sessions (client_id TEXT PRIMARY KEY, filters TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS retained (parent TEXT NOT NULL, lite TEXT NOT NULL, payload BLOB NOT NULL,"
    " qos INTEGER NOT NULL, stored_ms INTEGER NOT NULL, PRIMARY KEY (parent, lite)) WITHOUT ROWID",
    "CREATE TABLE IF NOT EXISTS wills (client_id TEXT PRIMARY KEY, due_ms INTEGER NOT NULL, topic TEXT NOT NULL,"
    " payload BLOB NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL, properties BLOB, host TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS wills_due ON wills (due_ms)",
    "CREATE TABLE IF NOT EXISTS armed (connection TEXT PRIMARY KEY, client_id TEXT NOT NULL, delay_s INTEGER NOT NULL,"
    " topic TEXT NOT NULL, payload BLOB NOT NULL, qos INTEGER NOT NULL, retain INTEGER NOT NULL, properties BLOB,"
    " host TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS qos2 (client_id TEXT NOT NULL, direction TEXT NOT NULL, packet_id INTEGER NOT NULL,"
    " message TEXT NOT NULL DEFAULT '', PRIMARY KEY (client_id, direction, packet_id)) WITHOUT ROWID",
)
INBOUND: Final = "in"  # a QoS 2 publish stored and answered PUBREC, its PUBREL not yet seen
OUTBOUND: Final = "out"  # a QoS 2 delivery answered PUBREC by the client, PUBREL sent, its PUBCOMP not yet seen
PUBLISHED: Final = "sent"  # a QoS 2 delivery written to the client, its PUBREC not yet seen (its packet id kept)
RESEND: Final = "resend"  # a retained message sent at QoS 1/2, unacknowledged when its connection ended
_ADDED_COLUMNS: Final = (  # (table, column, definition): MQTT 5 sessions and message properties
    ("sessions", "expiry_s", "INTEGER"),
    ("sessions", "gone_ms", "INTEGER"),
    ("sessions", "owner", "TEXT"),
    ("retained", "properties", "TEXT NOT NULL DEFAULT '{}'"),
    ("qos2", "qos", "INTEGER"),  # 1: a QoS 1 delivery's ``PUBLISHED`` row; NULL: QoS 2 (or not known)
)
NEVER: Final = 0xFFFFFFFF  # MQTT 5: a session expiry interval that never ends (a max of it caps nothing)


def _expired(max_expiry_s: int) -> str:
    """The SQL test of a session row past its expiry (one parameter: now, in ms)."""
    if max_expiry_s >= NEVER:
        return "gone_ms IS NOT NULL AND expiry_s IS NOT NULL AND gone_ms + expiry_s * 1000 <= ?"
    cap = int(max_expiry_s)
    return f"gone_ms IS NOT NULL AND gone_ms + min(coalesce(expiry_s, {cap}), {cap}) * 1000 <= ?"


@dataclass(frozen=True, slots=True)
class Will:
    """A will waiting for its delay: published at ``due_ms`` unless its client id connects again first.
    ``properties``: the will's MQTT 5 property section as it was read (None for 3.1.1)."""

    client_id: str
    due_ms: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: bytes | None
    host: str


@dataclass(frozen=True, slots=True)
class Retained:
    parent: str
    lite: str
    payload: bytes
    qos: int
    stored_ms: int
    properties: dict[str, str] = field(default_factory=dict)  # the message's (``mapping.incoming``)


@dataclass(frozen=True, slots=True)
class Unacked:
    """A retained message as it was sent at QoS 1 or 2 (its topic there, the subscription identifiers it
    carried), kept until the client acknowledges it: a resumed session gets it again (``RESEND`` rows)."""

    topic: str
    payload: bytes
    qos: int
    properties: dict[str, str]
    ids: tuple[int, ...] = ()

    def text(self) -> str:
        payload = base64.b64encode(self.payload).decode()
        return json.dumps([self.topic, payload, self.qos, self.properties, list(self.ids)])


def unacked_of(text: str) -> Unacked | None:
    """A ``RESEND`` row's text read back; None for one that does not read (dropped by the caller)."""
    try:
        topic, payload, qos, props, ids = json.loads(text)
        return Unacked(str(topic), base64.b64decode(payload), int(qos), {str(k): str(v) for k, v in props.items()},
                       tuple(int(i) for i in ids))  # fmt: skip
    except (ValueError, TypeError, AttributeError):
        return None


class Durable:
    def __init__(self, data_dir: Path, max_expiry_s: int = NEVER) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self._expired = _expired(max_expiry_s)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(data_dir / FILE_NAME, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        for statement in _SCHEMA:
            self._db.execute(statement)
        for table, column, definition in _ADDED_COLUMNS:
            present = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in present:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
        self._quiet = 0  # rows changed by the writes ``changes`` does not count (``_unsynced``)
        # session rows in the file, kept as they are written (``--mqtt-max-sessions``: no count(*) per CONNECT)
        self.sessions: int = self._db.execute("SELECT count(*) FROM sessions").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # --- sessions: client id -> {MQTT topic filter: subscription options} -----------------------------------
    def load_session(self, client_id: str, now_ms: int = 0) -> dict[str, int] | None:
        """The session's filters; None when there is none, or it expired by ``now_ms`` (then it is dropped)."""
        with self._lock:
            row = self._db.execute(
                f"SELECT filters, {self._expired} FROM sessions WHERE client_id = ?", (now_ms, client_id)
            ).fetchone()
            if row is not None and row[1]:
                self.sessions -= self._db.execute("DELETE FROM sessions WHERE client_id = ?", (client_id,)).rowcount
                self._db.execute("DELETE FROM qos2 WHERE client_id = ?", (client_id,))
                return None
        if row is None:
            return None
        filters: dict[str, int] = json.loads(row[0])
        return filters

    def save_session(self, client_id: str, filters: dict[str, int], expiry_s: int | None = None) -> None:
        """Store the session as connected (it does not expire while it is) with its expiry interval."""
        text = json.dumps(filters, sort_keys=True)
        with self._lock:
            known = self._db.execute("SELECT 1 FROM sessions WHERE client_id = ?", (client_id,)).fetchone()
            self._db.execute(
                "INSERT INTO sessions (client_id, filters, expiry_s, gone_ms) VALUES (?, ?, ?, NULL) "
                "ON CONFLICT (client_id) DO UPDATE SET filters = excluded.filters, expiry_s = excluded.expiry_s,"
                " gone_ms = NULL",
                (client_id, text, expiry_s),
            )
            self.sessions += known is None

    def session_ended(self, client_id: str, now_ms: int, expiry_s: int | None) -> None:
        """The session's connection ended at ``now_ms``: it expires ``expiry_s`` later (None: never)."""
        with self._lock:
            self._db.execute(
                "UPDATE sessions SET gone_ms = ?, expiry_s = ? WHERE client_id = ?", (now_ms, expiry_s, client_id)
            )

    def all_gone(self, now_ms: int) -> None:
        """At start: no session is connected; those a crash left marked connected start their expiry now."""
        with self._lock:
            self._db.execute("UPDATE sessions SET gone_ms = ? WHERE gone_ms IS NULL", (now_ms,))

    def expire_sessions(self, now_ms: int) -> int:
        with self._lock:
            dropped = self._db.execute(f"DELETE FROM sessions WHERE {self._expired}", (now_ms,)).rowcount
            self.sessions -= dropped
            if dropped:
                self._db.execute("DELETE FROM qos2 WHERE client_id NOT IN (SELECT client_id FROM sessions)")
            return dropped

    def has_session(self, client_id: str) -> bool:
        """Whether the client id has a session row (expired or not: resuming or replacing it adds no row)."""
        with self._lock:
            return self._db.execute("SELECT 1 FROM sessions WHERE client_id = ?", (client_id,)).fetchone() is not None

    def session_owner(self, client_id: str) -> tuple[bool, str | None]:
        """(whether the client id has a session row, the user that made it: None when unknown)."""
        with self._lock:
            row = self._db.execute("SELECT owner FROM sessions WHERE client_id = ?", (client_id,)).fetchone()
        return (False, None) if row is None else (True, row[0])

    def own_session(self, client_id: str, owner: str) -> None:
        """The session (saved already) belongs to ``owner`` from now on."""
        with self._lock:
            self._db.execute("UPDATE sessions SET owner = ? WHERE client_id = ?", (owner, client_id))

    def drop_session(self, client_id: str) -> bool:
        with self._lock:
            self._db.execute("DELETE FROM qos2 WHERE client_id = ?", (client_id,))
            dropped: int = self._db.execute("DELETE FROM sessions WHERE client_id = ?", (client_id,)).rowcount
            self.sessions -= dropped
            return dropped > 0

    # --- QoS 2 packet ids in flight: (client id, direction) -> packet ids ------------------------------------
    def qos2_ids(self, client_id: str, direction: str) -> dict[int, str]:
        """Packet id -> message id."""
        with self._lock:
            rows = self._db.execute(
                "SELECT packet_id, message FROM qos2 WHERE client_id = ? AND direction = ?", (client_id, direction)
            ).fetchall()
        return {packet_id: message for packet_id, message in rows}

    def qos2_update(
        self, client_id: str, direction: str, add: Iterable[tuple[int, str]], remove: Iterable[int]
    ) -> None:
        """In one transaction: ``add`` (packet id, message id) recorded, then ``remove`` forgotten."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "INSERT OR IGNORE INTO qos2 (client_id, direction, packet_id, message) VALUES (?, ?, ?, ?)",
                    [(client_id, direction, i, message) for i, message in add],
                )
                self._db.executemany(
                    "DELETE FROM qos2 WHERE client_id = ? AND direction = ? AND packet_id = ?",
                    [(client_id, direction, i) for i in remove],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def qos2_promise(
        self,
        client_id: str,
        direction: str,
        add: Iterable[tuple[int, str]],
        remove: Iterable[tuple[str, int, str]],
        *,
        lasting: bool = True,
        qos1: Collection[int] = (),
    ) -> None:
        """In one transaction: ``remove`` (direction, packet id, message) forgotten, each only while its row still
        names that message (a row of the id given to another delivery since stays), then ``add`` recorded over
        any row of its id, those of ``qos1`` marked QoS 1 (``qos1_ids``). ``lasting=False``: the commit is not
        fsynced (``synchronous=NORMAL``: on disk once the OS writes it back; a kill -9 of the broker loses
        nothing, a power cut may lose it)."""
        with self._lock, self._unsynced(not lasting), self._transaction():
            self._db.executemany(
                "DELETE FROM qos2 WHERE client_id = ? AND direction = ? AND packet_id = ? AND message = ?",
                [(client_id, d, i, message) for d, i, message in remove],
            )
            self._db.executemany(
                "INSERT OR REPLACE INTO qos2 (client_id, direction, packet_id, message, qos) VALUES (?, ?, ?, ?, ?)",
                [(client_id, direction, i, message, 1 if i in qos1 else None) for i, message in add],
            )

    def qos1_ids(self, client_id: str, direction: str) -> set[int]:
        """The packet ids of ``direction``'s rows recorded for QoS 1 deliveries (``qos2_promise``)."""
        with self._lock:
            rows = self._db.execute(
                "SELECT packet_id FROM qos2 WHERE client_id = ? AND direction = ? AND qos = 1", (client_id, direction)
            ).fetchall()
        return {packet_id for (packet_id,) in rows}

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """The writes within in one transaction (the lock held): committed, or rolled back on any exception."""
        self._db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    @contextlib.contextmanager
    def _unsynced(self, unsynced: bool = True) -> Iterator[None]:
        """With ``unsynced`` (the lock held): the writes within are not fsynced (``synchronous=NORMAL``) and not
        counted by ``changes`` (replication copies them with the next other change: they are kept for a kill -9
        of this process, not for the loss of its disk)."""
        if not unsynced:
            yield
            return
        before = self._db.total_changes
        self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            yield
        finally:
            self._db.execute("PRAGMA synchronous=FULL")
            self._quiet += self._db.total_changes - before

    def qos2_released(self, client_id: str, released: Iterable[tuple[int, str]], source: str = PUBLISHED) -> None:
        """In one transaction: deliveries the client answered PUBREC move from ``source`` (``PUBLISHED``, or
        ``RESEND`` for a retained one) to ``OUTBOUND``."""
        pairs = list(released)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "DELETE FROM qos2 WHERE client_id = ? AND direction = ? AND packet_id = ?",
                    [(client_id, source, i) for i, _ in pairs],
                )
                self._db.executemany(
                    "INSERT OR IGNORE INTO qos2 (client_id, direction, packet_id, message) VALUES (?, ?, ?, ?)",
                    [(client_id, OUTBOUND, i, message) for i, message in pairs],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def qos2_stored(self, client_id: str, packet_ids: Iterable[int], direction: str = INBOUND) -> None:
        """Rows whose message text no longer matters, cleared: inbound, the message is known stored (``exactly``:
        not looked for); outbound, the delivery is settled (its PUBCOMP only forgets the id)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.executemany(
                    "UPDATE qos2 SET message = '' WHERE client_id = ? AND direction = ? AND packet_id = ?",
                    [(client_id, direction, i) for i in packet_ids],
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def session_count(self) -> int:
        with self._lock:
            count: int = self._db.execute("SELECT count(*) FROM sessions").fetchone()[0]
        return count

    # --- retained messages: the last one per (parent, lite topic) -------------------------------------------
    def put_retained(self, changes: Iterable[Retained], *, tombstones: bool = False) -> None:
        """In one transaction, in order: an empty payload clears the topic's retained message; ``tombstones``
        (in a cluster) keeps the clear as a row with an empty payload, so that it outdates an older retained
        message another broker holds for the topic (a reader takes the newest per topic, then drops clears)."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for r in changes:
                    if r.payload or tombstones:
                        self._db.execute(
                            "INSERT INTO retained (parent, lite, payload, qos, stored_ms, properties)"
                            " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (parent, lite) DO UPDATE SET"
                            " payload = excluded.payload, qos = excluded.qos, stored_ms = excluded.stored_ms,"
                            " properties = excluded.properties",
                            (r.parent, r.lite, r.payload, r.qos, r.stored_ms, json.dumps(r.properties)),
                        )
                    else:
                        self._db.execute("DELETE FROM retained WHERE parent = ? AND lite = ?", (r.parent, r.lite))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def retained_between(self, parent: str, start_after: str, end_before: str) -> list[Retained]:
        """Retained messages of ``parent`` whose lite names lie in (start_after, end_before); "" is open.
        Clears kept as tombstones come too (an empty payload)."""
        query = "SELECT lite, payload, qos, stored_ms, properties FROM retained WHERE parent = ? AND lite > ?"
        args: tuple[str, ...] = (parent, start_after)
        if end_before:
            query += " AND lite < ?"
            args += (end_before,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY lite", args).fetchall()
        return [
            Retained(parent, lite, bytes(payload), qos, stored_ms, json.loads(props))
            for lite, payload, qos, stored_ms, props in rows
        ]

    def holding_retained(self, parents: Iterable[str]) -> set[str]:
        """Which of ``parents`` hold a retained message (or a clear kept): the filters of a SUBSCRIBE in a parent
        that holds none look for none (one lookup each, not a query per filter)."""
        with self._lock:
            return {
                parent
                for parent in parents
                if self._db.execute("SELECT 1 FROM retained WHERE parent = ? LIMIT 1", (parent,)).fetchone()
            }

    def retained_keys(self, parent: str, start_after: str, end_before: str, limit: int) -> list[Retained]:
        """Like ``retained_between``, at most ``limit``, without their payloads (``payload`` is b"" for a
        clear kept as a tombstone, else b"-"): a subscriber pages through them, reading each one's payload
        (``retained_one``) only as it sends it."""
        query = (
            "SELECT lite, length(payload) > 0, qos, stored_ms, properties FROM retained WHERE parent = ? AND lite > ?"
        )
        args: tuple[str | int, ...] = (parent, start_after)
        if end_before:
            query += " AND lite < ?"
            args += (end_before,)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY lite LIMIT ?", (*args, limit)).fetchall()
        return [
            Retained(parent, lite, b"-" if full else b"", qos, stored_ms, json.loads(props))
            for lite, full, qos, stored_ms, props in rows
        ]

    def retained_one(self, parent: str, lite: str) -> Retained | None:
        with self._lock:
            row = self._db.execute(
                "SELECT payload, qos, stored_ms, properties FROM retained WHERE parent = ? AND lite = ?", (parent, lite)
            ).fetchone()
        if row is None:
            return None
        payload, qos, stored_ms, props = row
        return Retained(parent, lite, bytes(payload), qos, stored_ms, json.loads(props))

    # --- wills waiting for their delay ------------------------------------------------------------------------
    def put_will(self, will: Will) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO wills (client_id, due_ms, topic, payload, qos, retain, properties, host)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (will.client_id, will.due_ms, will.topic, will.payload, will.qos, int(will.retain), will.properties,
                 will.host),
            )  # fmt: skip

    def arm_will(self, connection: str, delay_s: int, will: Will) -> None:
        """The will of a live connection (``will.due_ms`` unused), kept until the connection ends (``disarm_will``):
        a broker killed meanwhile publishes it after its restart (``fire_armed``). Not fsynced (a kill -9 loses
        nothing; a power cut may lose it, as it cuts the connection)."""
        with self._lock, self._unsynced():
            self._db.execute(
                "INSERT OR REPLACE INTO armed (connection, client_id, delay_s, topic, payload, qos, retain,"
                " properties, host) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (connection, will.client_id, delay_s, will.topic, will.payload, will.qos, int(will.retain),
                 will.properties, will.host),
            )  # fmt: skip

    def disarm_will(self, connection: str) -> None:
        """The connection ended: its will was published, delayed (a ``wills`` row) or dropped."""
        with self._lock, self._unsynced():
            self._db.execute("DELETE FROM armed WHERE connection = ?", (connection,))

    def disarm_all(self) -> int:
        """A broker stop, once every connection has ended: it publishes no will (docs/mqtt.md), so no ``armed``
        row may outlive it, not even one whose connection's end was cancelled or failed to delete it (the next
        start would publish it as a killed broker's); how many were left."""
        with self._lock, self._transaction():
            left: int = self._db.execute("DELETE FROM armed").rowcount
        return left

    def fire_armed(self, now_ms: int) -> int:
        """At start: the wills of connections that ended with the broker's last run (killed, no end recorded)
        become wills waiting for their delay from ``now_ms`` (one client id's newest over an older one);
        how many."""
        with self._lock, self._transaction():
            moved: int = self._db.execute(
                "INSERT OR REPLACE INTO wills (client_id, due_ms, topic, payload, qos, retain, properties, host)"
                " SELECT client_id, ? + delay_s * 1000, topic, payload, qos, retain, properties, host FROM armed"
                " ORDER BY rowid",
                (now_ms,),
            ).rowcount
            self._db.execute("DELETE FROM armed")
        return moved

    def next_will(self) -> tuple[str, int] | None:
        """(client id, due ms) of the will due first (the timer waits for it; nothing of the others is read)."""
        with self._lock:
            row = self._db.execute("SELECT client_id, due_ms FROM wills ORDER BY due_ms LIMIT 1").fetchone()
        return None if row is None else (row[0], row[1])

    def take_will(self, client_id: str, due_ms: int | None = None) -> Will | None:
        """The client id's will, deleted (published or cancelled by the caller); with ``due_ms``, only the will
        due then (a newer one that replaced it waits on)."""
        with self._lock:
            row = self._db.execute(
                "SELECT due_ms, topic, payload, qos, retain, properties, host FROM wills WHERE client_id = ?",
                (client_id,),
            ).fetchone()
            if row is None or (due_ms is not None and row[0] != due_ms):
                return None
            self._db.execute("DELETE FROM wills WHERE client_id = ?", (client_id,))
        due, topic, payload, qos, retain, props, host = row
        return Will(client_id, due, topic, bytes(payload), qos, bool(retain), None if props is None else bytes(props),
                    host)  # fmt: skip

    def will_count(self) -> int:
        with self._lock:
            count: int = self._db.execute("SELECT count(*) FROM wills").fetchone()[0]
        return count

    # --- replication (``lmq_broker.replication.stating``): whole rows out, and in at a takeover ----------------
    def changes(self) -> int:
        """Grows with every row written or deleted since the file was opened (nothing new to copy: unchanged), but
        those of the unsynced writes (``_unsynced``: a QoS 1 delivery's packet id, a live connection's will)."""
        with self._lock:
            return self._db.total_changes - self._quiet

    def rows(self, table: str) -> list[dict[str, object]]:
        """Every row of a ``REPLICATED`` table, as column -> value."""
        columns = ", ".join(REPLICATED[table][1])
        with self._lock:
            found = self._db.execute(f"SELECT {columns} FROM {table}").fetchall()
        return [dict(zip(REPLICATED[table][1], row, strict=True)) for row in found]

    def merge(self, table: str, rows: Iterable[dict[str, object]], now_ms: int) -> None:
        """Rows another broker held (a slot this broker took over), in one transaction: a session or QoS 2 row
        only where this broker has none of its key (its own is newer: its client came here), a retained message
        only over an older one; a session still marked connected there is gone from now (its expiry starts)."""
        _, columns, rule = REPLICATED[table]
        names, marks = ", ".join(columns), ", ".join("?" for _ in columns)
        with self._lock:
            self._db.execute("BEGIN")
            try:
                added = 0
                for row in rows:
                    values = [row.get(c) for c in columns]
                    if table == "sessions" and row.get("gone_ms") is None:
                        values[columns.index("gone_ms")] = now_ms
                    added += self._db.execute(f"INSERT INTO {table} ({names}) VALUES ({marks}) {rule}", values).rowcount
                self._db.execute("COMMIT")
                if table == "sessions":  # a take-over's sessions count against the cap from now on, never refused
                    self.sessions += added
            except BaseException:
                self._db.execute("ROLLBACK")
                raise


# table -> (its key columns, every column copied, the merge rule). A will waiting for its delay is copied too: the
# broker that takes the slot over publishes it when due (unless its client id is back there: its own row, or none)
REPLICATED: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...], str]]] = {
    "sessions": (
        ("client_id",),
        ("client_id", "filters", "expiry_s", "gone_ms", "owner"),
        "ON CONFLICT (client_id) DO NOTHING",
    ),
    "qos2": (
        ("client_id", "direction", "packet_id"),
        ("client_id", "direction", "packet_id", "message", "qos"),
        "ON CONFLICT (client_id, direction, packet_id) DO NOTHING",
    ),
    "wills": (
        ("client_id",),
        ("client_id", "due_ms", "topic", "payload", "qos", "retain", "properties", "host"),
        "ON CONFLICT (client_id) DO NOTHING",
    ),
    "retained": (
        ("parent", "lite"),
        ("parent", "lite", "payload", "qos", "stored_ms", "properties"),
        "ON CONFLICT (parent, lite) DO UPDATE SET payload = excluded.payload, qos = excluded.qos,"
        " stored_ms = excluded.stored_ms, properties = excluded.properties WHERE excluded.stored_ms > stored_ms",
    ),
}
