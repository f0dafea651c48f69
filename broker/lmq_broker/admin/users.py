"""Users and policy entries over the admin service: validated, idempotent changes of the stored document.

Blocking; the service runs each call in a worker thread. Every change reads the document, changes it, writes
it (synced) under one lock and hands the new one to the broker's ``AccessControl``, so it applies from the
next call on, without a restart. The service sends each change on to the cluster's other members (as parent
topics), which apply it the same way. Secrets go in and never come out: responses carry users without them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from lmq_broker import errors
from lmq_broker.access import document, policy
from lmq_broker.access.control import AccessControl
from lmq_broker.protocol.gen.lmq.admin.v1 import admin_pb2 as pb
from lmq_broker.storage.api import Store


@dataclass(frozen=True, slots=True)
class Counted:
    count: int  # entries created, deleted, or that a user has
    changed: bool


class Users:
    def __init__(self, store: Store, access: AccessControl) -> None:
        self._store = store
        self._access = access
        self._lock = threading.Lock()

    def load(self) -> None:
        """At start: the stored document becomes the broker's rules."""
        with self._lock:
            self._access.load(document.decode(self._store.get_access()))

    def _read(self) -> document.Document:
        return document.decode(self._store.get_access())

    def _write(self, doc: document.Document) -> None:
        self._store.put_access(document.encode(doc))
        self._access.load(doc)

    # --- users --------------------------------------------------------------------------------------------
    def put_user(self, user: policy.User) -> tuple[policy.User, bool]:
        """An empty secret keeps the user's own (a change of its flags); a new user needs one."""
        with self._lock:
            doc = self._read()
            existing = doc.user(user.name)
            if not user.secret and existing is not None:
                user = policy.User(user.name, existing.secret, user.super_user, user.enabled)
            user = policy.checked_user(user)
            if existing != user:
                self._write(document.with_user(doc, user))
            return user, existing is None

    def get_user(self, name: str) -> tuple[policy.User, int]:
        doc = self._read()
        user = doc.user(name)
        if user is None:
            raise errors.NotFound(f"user {name} does not exist", kind="user", user=name)
        return user, len(doc.entries_of(name))

    def delete_user(self, name: str) -> tuple[bool, int]:
        """(whether the user existed, how many of its entries went with it)."""
        with self._lock:
            doc = self._read()
            if doc.user(name) is None and not doc.entries_of(name):
                return False, 0
            dropped = len(doc.entries_of(name))
            self._write(document.without_user(doc, name))
            return True, dropped

    def list_users(self) -> list[tuple[policy.User, int]]:
        doc = self._read()
        return [(u, len(doc.entries_of(u.name))) for u in sorted(doc.users, key=lambda u: u.name)]

    # --- policy entries -----------------------------------------------------------------------------------
    def put_entries(self, entries: Sequence[policy.Entry]) -> tuple[list[policy.Entry], int]:
        """(the entries as stored, how many are new); entries replace those of the same (user, resource,
        decision). Each entry's user must exist: a typo must not leave a policy that applies to no one."""
        if not entries:
            raise errors.InvalidArgument("no acl entry given", kind="acl")
        checked = [policy.checked_entry(e) for e in entries]
        with self._lock:
            doc = self._read()
            for entry in checked:
                if doc.user(entry.user) is None:
                    raise errors.NotFound(
                        f"user {entry.user} does not exist: lmq-admin user put {entry.user} first", kind="user"
                    )
            known = {e.key for e in doc.entries}
            created = sum(1 for e in checked if e.key not in known)
            changed = document.with_entries(doc, checked)
            if changed != doc:
                self._write(changed)
            return checked, created

    def get_entries(self, user: str) -> list[policy.Entry]:
        return list(self._read().entries_of(user))

    def delete_entries(self, user: str, resource: str = "", decision: policy.Decision | None = None) -> int:
        with self._lock:
            doc = self._read()
            changed = document.without_entries(doc, user, resource, decision)
            gone = len(doc.entries) - len(changed.entries)
            if gone:
                self._write(changed)
            return gone

    def list_entries(self) -> list[policy.Entry]:
        return sorted(self._read().entries, key=lambda e: e.key)


# --- wire conversions -----------------------------------------------------------------------------------------


def user_from_pb(user: pb.User) -> policy.User:
    return policy.User(user.name, user.secret, user.super_user, not user.disabled)


def user_to_pb(user: policy.User) -> pb.User:
    """Without its secret: secrets go in, never out."""
    return pb.User(name=user.name, super_user=user.super_user, disabled=not user.enabled)


def entry_from_pb(entry: pb.AclEntry) -> policy.Entry:
    return policy.Entry(
        entry.user,
        entry.resource,
        tuple(policy.action_of(a) for a in entry.actions),
        policy.decision_of(entry.decision or policy.Decision.ALLOW.value),
        tuple(entry.sources),
    )


def entry_to_pb(entry: policy.Entry) -> pb.AclEntry:
    return pb.AclEntry(
        user=entry.user,
        resource=entry.resource,
        actions=[a.value for a in entry.actions],
        decision=entry.decision.value,
        sources=list(entry.sources),
    )
