"""The stored form of users and policy entries: one JSON document in the meta store (``X access``).

Users and policies are few (a user per tenant or application) and change rarely, so the whole set is one
record, rewritten (synced) on every change under the admin catalog's lock; a broker reads it at start and
after each change. Secrets are stored as given: ``MQv2-HMAC-SHA1`` needs the secret itself to check a
signature, as RocketMQ's own ACL does. The meta store lives in the data directory, which only operators read
(docs/security.md)::

    {"version": 1,
     "users": [{"name": "alice", "secret": "...", "super": false, "enabled": true}],
     "entries": [{"user": "alice", "resource": "Lite:chat/a-*", "actions": ["Pub", "Sub"],
                  "decision": "Allow", "sources": ["10.0.0.0/8"]}]}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from lmq_broker import errors
from lmq_broker.access import policy

VERSION: Final = 1


@dataclass(frozen=True, slots=True)
class Document:
    users: tuple[policy.User, ...] = ()
    entries: tuple[policy.Entry, ...] = ()

    def user(self, name: str) -> policy.User | None:
        return next((u for u in self.users if u.name == name), None)

    def entries_of(self, user: str) -> tuple[policy.Entry, ...]:
        return tuple(e for e in self.entries if e.user == user)

    def rules(self) -> policy.Rules:
        return policy.compile_rules(self.users, self.entries)


def encode(doc: Document) -> str:
    return json.dumps(
        {
            "version": VERSION,
            "users": [
                {"name": u.name, "secret": u.secret, "super": u.super_user, "enabled": u.enabled} for u in doc.users
            ],
            "entries": [
                {
                    "user": e.user,
                    "resource": e.resource,
                    "actions": [a.value for a in e.actions],
                    "decision": e.decision.value,
                    "sources": list(e.sources),
                }
                for e in doc.entries
            ],
        },
        sort_keys=True,
    )


def decode(text: str | None) -> Document:
    if not text:
        return Document()
    data: dict[str, Any] = json.loads(text)
    if data.get("version", VERSION) > VERSION:
        raise errors.UnsupportedVersion(f"access document version {data['version']} is newer than {VERSION}")
    users = tuple(
        policy.User(u["name"], u["secret"], bool(u.get("super", False)), bool(u.get("enabled", True)))
        for u in data.get("users", ())
    )
    entries = tuple(
        policy.Entry(
            e["user"],
            e["resource"],
            tuple(policy.action_of(a) for a in e["actions"]),
            policy.decision_of(e.get("decision", "Allow")),
            tuple(e.get("sources", ())),
        )
        for e in data.get("entries", ())
    )
    return Document(users, entries)


def with_user(doc: Document, user: policy.User) -> Document:
    return Document((*(u for u in doc.users if u.name != user.name), user), doc.entries)


def without_user(doc: Document, name: str) -> Document:
    """The user and every entry naming it."""
    return Document(tuple(u for u in doc.users if u.name != name), tuple(e for e in doc.entries if e.user != name))


def with_entries(doc: Document, entries: Sequence[policy.Entry]) -> Document:
    """``entries`` replace those of the same (user, resource, decision)."""
    keys = {e.key for e in entries}
    return Document(doc.users, (*(e for e in doc.entries if e.key not in keys), *entries))


def without_entries(doc: Document, user: str, resource: str = "", decision: policy.Decision | None = None) -> Document:
    """Without the entries of ``user`` (on ``resource``, of ``decision``, when given)."""

    def gone(e: policy.Entry) -> bool:
        return e.user == user and resource in ("", e.resource) and decision in (None, e.decision)

    return Document(doc.users, tuple(e for e in doc.entries if not gone(e)))
