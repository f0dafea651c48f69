"""``lmq-admin user …`` and ``lmq-admin acl …``: users and access policies (docs/security.md, "Access control").

A secret is given by ``LMQ_USER_SECRET`` (kept out of the process list) or ``--secret``; ``--generate-secret``
makes one and prints it this once (the broker never shows a secret again). ``user put`` of an existing user
without a secret keeps its secret and changes only the flags given.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Final, TypeAlias

from lmq_broker import errors
from lmq_broker.admin import credentials
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import AclEntry, UserPut

SECRET_ENV: Final = "LMQ_USER_SECRET"
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Verb: TypeAlias = Callable[
    [Subparsers, str, Callable[[AdminClient, argparse.Namespace], object], str], argparse.ArgumentParser
]


def _put_user(admin: AdminClient, a: argparse.Namespace) -> UserPut:
    try:
        kept = admin.get_user(a.name)
        super_user, enabled = kept.super_user, kept.enabled
    except errors.NotFound:
        super_user, enabled = False, True
    secret = a.secret or os.environ.get(SECRET_ENV, "")
    if a.generate_secret:
        secret = credentials.new_secret(24)
    put = admin.put_user(
        a.name,
        secret,
        super_user=super_user if a.super is None else a.super,
        enabled=enabled if a.enabled is None else a.enabled,
    )
    return UserPut(put.name, put.super_user, put.enabled, put.created, secret if a.generate_secret else "")


def _put_acl(admin: AdminClient, a: argparse.Namespace) -> object:
    actions = tuple(x.strip() for x in a.actions.split(",") if x.strip())
    sources = tuple(x.strip() for x in (a.sources or "").split(",") if x.strip())
    return admin.put_acl([AclEntry(a.user, r, actions, a.decision, sources) for r in a.resource])


def add(resources: Subparsers, verb: Verb) -> None:
    users = resources.add_parser("user", help="users of the v2 service and MQTT (--acl)").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    put = verb(users, "put", _put_user, "create or update (the secret: env LMQ_USER_SECRET, --secret or generated)")
    put.add_argument("name", help="the access key (MQTT: the username)")
    put.add_argument("--secret", default="", help=f"the secret key (MQTT: the password); prefer env {SECRET_ENV}")
    put.add_argument("--generate-secret", action="store_true", help="make one and print it this once")
    put.add_argument("--super", action=argparse.BooleanOptionalAction, help="may do everything (default off)")
    put.add_argument("--enabled", action=argparse.BooleanOptionalAction, help="may sign in (default on)")
    verb(users, "get", lambda c, a: c.get_user(a.name), "show one (never its secret)").add_argument("name")
    verb(users, "delete", lambda c, a: c.delete_user(a.name), "delete, with its acl entries").add_argument("name")
    verb(users, "list", lambda c, a: c.list_users(), "list all")

    acls = resources.add_parser("acl", help="access policies of users (--acl)").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    put = verb(acls, "put", _put_acl, "create or replace the entries of (user, resource, decision)")
    put.add_argument("user")
    put.add_argument(
        "resource",
        nargs="+",
        help="Topic:<name>, Group:<name>, Lite:<parent>/<name> or *; a name may end with * (prefix) or hold * and ?",
    )
    put.add_argument("--actions", required=True, help="comma-separated: Pub,Sub,Create,Update,Delete,Get,List")
    put.add_argument("--decision", choices=("Allow", "Deny"), default="Allow", help="a deny wins (default Allow)")
    put.add_argument("--sources", help="comma-separated CIDRs the entry applies to (default: every address)")
    verb(acls, "get", lambda c, a: c.get_acl(a.user), "a user's entries").add_argument("user")
    delete = verb(acls, "delete", lambda c, a: c.delete_acl(a.user, a.resource, a.decision), "delete entries")
    delete.add_argument("user")
    delete.add_argument("resource", nargs="?", default="", help="only the entries on this resource (default: all)")
    delete.add_argument("--decision", choices=("Allow", "Deny"), default="", help="only these (default: both)")
    verb(acls, "list", lambda c, a: c.list_acls(), "every user's entries")
