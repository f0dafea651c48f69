"""``lmq-admin``: the admin service from a shell, one subcommand per resource and verb.

A thin layer over ``AdminClient``: parse, call, print. Exit codes: 0 done, 1 the broker refused or
failed (its message on stderr), 2 bad usage. The service's ``Put*`` replaces the whole object, so
``parent-topic put`` and ``group put`` of an object that exists read it first and change only the fields
whose options were given (read, merge, put: a concurrent writer between the read and the put loses its
change). ``quota put`` sends the whole quota. A broker with peers applies such changes on every member
(``admin.everywhere``), unless ``--here-only``; a member that did not take one makes the command fail, naming it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, TextIO, TypeVar

from lmq_broker import errors, model
from lmq_broker.admin import access_cli, backup_cli, credentials, tls
from lmq_broker.admin.client import AdminClient
from lmq_broker.admin.results import GroupInfo, GroupLag, LiteTopicPage
from lmq_broker.cluster import membership as mb
from lmq_broker.dispatch.offsets import OffsetPolicy, OffsetReset

DEFAULT_ENDPOINT: Final = "localhost:8081"
ENDPOINT_ENV: Final = "LMQ_ADMIN_ENDPOINT"
ACCESS_KEY_ENV: Final = credentials.ACCESS_KEY_ENV
SECRET_KEY_ENV: Final = credentials.SECRET_KEY_ENV
DATA_DIR_ENV: Final = credentials.DATA_DIR_ENV
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
_WRAPPERS: Final = frozenset({"topic", "group", "meta", "value", "client"})  # nested values printed as their fields
T = TypeVar("T")


def _reclaim_cell(run: Mapping[str, Any] | None) -> str:
    """A parent's last reclaim run in one table cell (``-o json`` keeps every field). One cell, not a column
    per field: a list mixes parents with and without a run, and a table has one header."""
    if not run:
        return "-"
    dry = " (dry run)" if run["dry_run"] else ""
    return f"{run['run_id']}: reclaimed {run['reclaimed']} of {run['expired']}{dry}"


_CELLS: Final[Mapping[str, Callable[[Any], str]]] = {"last_reclaim": _reclaim_cell}
# Tables print these epoch-millisecond fields as UTC times (``-o json`` keeps the numbers); 0 is "never".
_TIMES: Final = frozenset(
    {"last_seen_ms", "created_ms", "last_store_ms", "last_consume_ms", "store_timestamp_ms", "born_timestamp_ms"}
    | {"start_ms", "finish_ms", "taken_ms"}
)
# `group list` as a table: the columns that tell groups apart (-o json and `group get` show every field)
_GROUP_LIST_COLUMNS: Final = (
    "name",
    "bind_topic",
    "model",
    "retry.max_attempts",
    "retry.backoff_ms",
    "fifo",
    "subscription_count",
    "client_count",
    "lag",
)
_STEPS_SHOWN: Final = 4  # a longer backoff list shows its first and last steps and how many there are


def _time_cell(ms: int) -> str:
    return "-" if ms <= 0 else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


def _duration(ms: int) -> str:
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size}{unit}"
    return f"{ms}ms"


def _backoff_cell(steps: Sequence[int]) -> str:
    shown = [_duration(ms) for ms in steps]
    if len(shown) <= _STEPS_SHOWN:
        return ",".join(shown)
    return f"{','.join(shown[:2])}…{','.join(shown[-2:])} ({len(shown)} steps)"


def plain(value: Any) -> Any:
    """JSON-ready: dataclasses → dicts, enums → names, tuples → lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def flatten(record: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """One table row: wrapper objects (topic, group, meta, value) give their own fields, others get dotted names."""
    row: dict[str, Any] = {}
    for key, value in record.items():
        if key in _CELLS and not prefix:
            row[key] = _CELLS[key](value)
        elif isinstance(value, dict) and value and (key in _WRAPPERS and not prefix):
            row.update(flatten(value))
        elif isinstance(value, dict) and value and key not in ("group_offsets",):
            row.update(flatten(value, f"{prefix}{key}."))
        elif isinstance(value, dict):
            row[prefix + key] = ",".join(f"{k}={v}" for k, v in value.items())
        elif isinstance(value, list) and key == "backoff_ms":
            row[prefix + key] = _backoff_cell(value)
        elif isinstance(value, list):
            row[prefix + key] = ",".join(str(v) for v in value)
        elif key in _TIMES and isinstance(value, int):
            row[prefix + key] = _time_cell(value)
        else:
            row[prefix + key] = value
    return row


TABLE_MAX_WIDTH: Final = 120  # one object wider than this as a table is printed a field per line


def _table_width(rows: Sequence[Mapping[str, Any]]) -> int:
    names = list(rows[0])
    return sum(max(len(name), *(len(str(r.get(name, ""))) for r in rows)) for name in names) + 2 * (len(names) - 1)


def print_record(row: Mapping[str, Any], out: TextIO) -> None:
    """``FIELD  value`` lines, the field names aligned (what ``kubectl describe`` does for one object)."""
    width = max(len(name) for name in row)
    for name, value in row.items():
        print(f"{name.upper().ljust(width)}  {value}".rstrip(), file=out)


def print_table(rows: Sequence[Mapping[str, Any]], out: TextIO, header: bool = True) -> None:
    if not rows:
        if header:
            print("(none)", file=out)
        return
    names = list(rows[0])
    widths = [max(len(name), *(len(str(r.get(name, ""))) for r in rows)) for name in names]
    lines = [[str(r.get(name, "")) for name in names] for r in rows]
    if header:
        lines.insert(0, [name.upper() for name in names])
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip(), file=out)


def emit(result: object, output: str, out: TextIO) -> None:
    data = plain(result)
    if output == "json":
        json.dump(data, out, indent=2, sort_keys=False)
        out.write("\n")
        return
    if isinstance(result, LiteTopicPage):  # one row per lite topic; the cursor of the next page below them
        print_table([flatten(t) for t in data["topics"]], out)
        if result.next_start_after:
            print(f"(more: --start-after {result.next_start_after})", file=out)
        return
    if isinstance(result, GroupLag):
        _emit_group_lag(result, out)
        return
    records = data if isinstance(data, list) else [data]
    rows = [flatten(r) if isinstance(r, dict) else {"result": r} for r in records]
    if isinstance(result, list) and result and isinstance(result[0], GroupInfo):  # `group get G` has them all
        rows = [{name: row.get(name, "") for name in _GROUP_LIST_COLUMNS} for row in rows]
    if not isinstance(data, list) and len(rows) == 1 and _table_width(rows) > TABLE_MAX_WIDTH:
        print_record(rows[0], out)  # one object too wide for a terminal: a field per line
        return
    print_table(rows, out)


# --- commands --------------------------------------------------------------------------------------------
def _given(value: T | None, kept: T) -> T:
    """An option's value, or what the object had when the option was left out (its default is None)."""
    return kept if value is None else value


def _put_parent(admin: AdminClient, a: argparse.Namespace) -> object:
    try:
        kept = admin.get_parent_topic(a.name).topic
    except errors.TopicNotFound:
        kept = model.ParentTopic(a.name)
    message_type = model.MessageType[a.message_type] if a.message_type is not None else kept.message_type
    return admin.put_parent_topic(
        model.ParentTopic(
            a.name,
            message_type,
            expiration_minutes=_given(a.expiration_minutes, kept.expiration_minutes),
            max_lite_topics=_given(a.max_lite_topics, kept.max_lite_topics),
            queue_count=_given(a.queues, kept.queue_count),
        )
    )


def _put_group(admin: AdminClient, a: argparse.Namespace) -> object:
    try:
        kept = admin.get_group(a.name).group
    except errors.GroupNotFound:
        # Zeros and an empty backoff ask the broker for its configured defaults.
        kept = model.LiteGroup(a.name, a.bind_topic, client_quota=0, ready_capacity=0, retry=model.RetryPolicy(0, ()))
    return admin.put_group(
        model.LiteGroup(
            a.name,
            a.bind_topic,  # immutable: a different one is refused by the broker (Conflict)
            model=model.SubscriptionModel(a.model.capitalize()) if a.model is not None else kept.model,
            client_quota=_given(a.client_quota, kept.client_quota),
            ready_capacity=_given(a.ready_capacity, kept.ready_capacity),
            retry=model.RetryPolicy(
                max_attempts=_given(a.max_attempts, kept.retry.max_attempts),
                backoff_ms=_given(a.backoff_ms, kept.retry.backoff_ms),
            ),
            fifo=_given(a.fifo, kept.fifo),
            consume_enabled=_given(a.consume_enabled, kept.consume_enabled),
            wildcard=_given(a.wildcard, kept.wildcard),
            lite_patterns=_given(a.lite_patterns, kept.lite_patterns),
        )
    )


def _patterns(text: str) -> tuple[str, ...]:
    return tuple(p for p in text.split(",") if p)


def _seconds(text: str) -> float:
    """``--timeout``: a positive number of seconds (0 or less would fail every call as timed out)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _milliseconds(text: str) -> tuple[int, ...]:
    """``--backoff-ms 1000,5000,60000``: the delay before each redelivery, in ms; an empty value asks the
    broker for its default backoff."""
    try:
        return tuple(int(part) for part in text.split(",")) if text.strip() else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {text!r}") from None


def _put_quota(admin: AdminClient, a: argparse.Namespace) -> object:
    return admin.put_quota(
        model.Quota(
            a.scope,
            max_lite_topics=a.max_lite_topics,
            max_subscriptions_per_client=a.max_subscriptions_per_client,
            max_send_rate=a.max_send_rate,
        )
    )


def _scan(admin: AdminClient, a: argparse.Namespace, out: TextIO) -> None:
    first = True
    for columns in admin.scan_lite_topics_columns(
        a.parent,
        start_after=a.start_after,
        end_before=a.end_before,
        batch_size=a.batch_size,
        with_subscribers=a.with_subscribers,
        with_fully_consumed=a.with_fully_consumed,
    ):
        names = list(columns)
        rows = [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
        if a.output == "json":  # JSON Lines: a scan may not fit in memory, so no enclosing array
            for row in rows:
                out.write(json.dumps(row) + "\n")
        else:
            print_table(rows, out, header=first)
        first = False
    if first and a.output != "json":
        print("(none)", file=out)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ring sizes, got {text!r}") from None


def _set_cluster(admin: AdminClient, a: argparse.Namespace) -> object:
    """One broker, or (``--everywhere``) every broker of the old and new membership: joining ones first, then
    the leaving ones (so that they send on what reaches them by the old view), then the rest, removed ones last.
    Each on its admin service: its member endpoint's host at the admin port the first broker reports (its
    --admin-port, which every broker of a cluster shares) unless ``--admin-port`` says otherwise. This command is
    then the change's one writer: every broker gets the same membership epoch, one past the newest any of them
    that answers has (docs/scale-out.md, Membership epochs)."""
    members = tuple(m.strip() for m in a.peers.split(",") if m.strip())
    sizes = (*a.ring_history, a.ring_size if a.ring_size is not None else len(members))
    if not a.everywhere:
        info, changed = admin.set_cluster(members, sizes, slot=a.slot, force=a.force)
        return {"endpoint": admin.endpoint, "slot": info.slot, "changed": changed, "leaving": info.leaving}
    current = admin.cluster()
    old = current.members
    admin_port = a.admin_port if a.admin_port is not None else current.admin_port
    today = sizes[-1]
    order = [m for m in members if m not in old]
    order += [m for m in members[today:] if m not in order]
    order += [m for m in members if m not in order]
    order += [m for m in old if m not in members and m]

    def client(endpoint: str) -> AdminClient:
        return AdminClient(
            mb.admin_endpoint(endpoint, admin_port),
            admin.aio.timeout_s,
            long_timeout_s=admin.aio.long_timeout_s,
            keys=a.keys,
            tls=a.tls,
        )

    epoch = current.epoch
    for endpoint in order:
        with contextlib.suppress(errors.LmqError), client(endpoint) as each:
            epoch = max(epoch, each.cluster().epoch)
    rows = []
    for endpoint in order:
        with client(endpoint) as each:
            info, changed = each.set_cluster(members, sizes, force=a.force, epoch=epoch + 1)
        rows.append({"endpoint": endpoint, "slot": info.slot, "changed": changed, "leaving": info.leaving})
    return rows


def _parser() -> argparse.ArgumentParser:  # noqa: PLR0915 (the argument parser: a statement per command and flag)
    parser = argparse.ArgumentParser(prog="lmq-admin", description="Administer one lmq broker.")
    parser.add_argument(
        "--endpoint",
        default=os.environ.get(ENDPOINT_ENV, DEFAULT_ENDPOINT),
        help=f"broker admin address host:port (env {ENDPOINT_ENV}, default {DEFAULT_ENDPOINT})",
    )
    parser.add_argument("--timeout", type=_seconds, default=10.0, help="seconds per call (default 10)")
    parser.add_argument("--output", "-o", choices=("table", "json"), default="table")
    parser.add_argument(
        "--access-key", default="", help=f"the broker's admin access key (else env {ACCESS_KEY_ENV}, else --data-dir)"
    )
    parser.add_argument(
        "--secret-key", default="", help=f"its secret key; prefer env {SECRET_KEY_ENV} (kept out of the process list)"
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help=f"read the admin key pair from <data-dir>/{credentials.FILE_NAME} when neither flags nor env give one "
        f"(env {DATA_DIR_ENV}, default {credentials.DEFAULT_DATA_DIR}: where `make run` keeps it)",
    )
    parser.add_argument(
        "--tls-ca",
        default=None,
        help=f"speak TLS, trusting brokers whose certificate this PEM CA signed (env {tls.CA_ENV}; default plaintext)",
    )
    parser.add_argument(
        "--tls-server-name",
        default=None,
        help=f"the name the broker's certificate must carry, whatever --endpoint's host (env {tls.SERVER_NAME_ENV})",
    )
    parser.add_argument(
        "--here-only",
        action="store_true",
        help="change parent topics, groups and quotas on --endpoint's broker only; by default a broker with peers "
        "sends each change on to every other member and fails the call, naming them, when one did not take it",
    )
    resources = parser.add_subparsers(dest="resource", required=True, metavar="RESOURCE")

    def verb(
        verbs: argparse._SubParsersAction[argparse.ArgumentParser],
        name: str,
        run: Callable[[AdminClient, argparse.Namespace], object] | None,
        help: str,
    ) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help)
        sub.set_defaults(run=run)
        return sub

    topics = resources.add_parser(
        "parent-topic", help="topics: LITE parents of lite topics, or NORMAL topics"
    ).add_subparsers(dest="verb", required=True, metavar="VERB")
    put = verb(topics, "put", _put_parent, "create or update")
    put.add_argument("name")
    put.add_argument(
        "--message-type",
        choices=("LITE", "NORMAL"),
        help="LITE (default): parent of lite topics; NORMAL: for PushConsumer/SimpleConsumer. Immutable once set",
    )
    put.add_argument("--queues", type=int, help="queues of a NORMAL topic, 1..64 (default 1; LITE: 1); never shrinks")
    put.add_argument(
        "--expiration-minutes", type=int, help="LITE only: idle minutes before reclaim, -1 never (default)"
    )
    put.add_argument("--max-lite-topics", type=int, help="LITE only: -1 (default) unlimited")
    verb(topics, "get", lambda c, a: c.get_parent_topic(a.name), "show one").add_argument("name")
    delete = verb(
        topics, "delete", lambda c, a: c.delete_parent_topic(a.name, purge_lite_topics=a.purge_lite_topics), "delete"
    )
    delete.add_argument("name")
    delete.add_argument("--purge-lite-topics", action="store_true", help="also delete its lite topics")
    verb(topics, "list", lambda c, a: c.list_parent_topics(), "list all")

    groups = resources.add_parser("group", help="lite consumer groups").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    put = verb(groups, "put", _put_group, "create or update")
    put.add_argument("name")
    put.add_argument("--bind-topic", required=True, help="the parent topic (immutable once set)")
    put.add_argument("--model", choices=("shared", "exclusive"), help="default shared")
    put.add_argument("--client-quota", type=int, help="lite subscriptions per client (0: the broker's default)")
    put.add_argument("--ready-capacity", type=int, help="ready events per client, >= 10 (0: the broker's default)")
    put.add_argument("--max-attempts", type=int, help="deliveries before the DLQ (0: the broker's default, 17)")
    put.add_argument(
        "--backoff-ms",
        type=_milliseconds,
        help="comma-separated delays before each redelivery in ms, e.g. 1000,5000,30000 ('': the broker's default)",
    )
    put.add_argument("--fifo", action=argparse.BooleanOptionalAction, help="default --fifo")
    put.add_argument("--consume-enabled", action=argparse.BooleanOptionalAction, help="default --consume-enabled")
    put.add_argument(
        "--wildcard", action=argparse.BooleanOptionalAction, help="every lite topic of the bind topic (default off)"
    )
    put.add_argument(
        "--lite-patterns",
        type=_patterns,
        help="a wildcard group's comma-separated patterns, e.g. 'session-*,dev/+/cmd': only the lite topics they "
        "match ('': every lite topic)",
    )
    verb(groups, "get", lambda c, a: c.get_group(a.name), "show one, with lag").add_argument("name")
    verb(groups, "delete", lambda c, a: c.delete_group(a.name), "delete").add_argument("name")
    verb(groups, "list", lambda c, a: c.list_groups(), "list all")

    quotas = resources.add_parser("quota", help="limits per broker, parent or namespace").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    put = verb(quotas, "put", _put_quota, "create or update")
    put.add_argument("scope", help="broker | parent:<topic> | namespace:<ns>")
    put.add_argument("--max-lite-topics", type=int, default=-1)
    put.add_argument("--max-subscriptions-per-client", type=int, default=-1)
    put.add_argument("--max-send-rate", type=int, default=-1, help="messages per second")
    verb(quotas, "delete", lambda c, a: c.delete_quota(a.scope), "delete").add_argument("scope")
    verb(quotas, "list", lambda c, a: c.list_quotas(), "list all")

    access_cli.add(resources, verb)

    lites = resources.add_parser("lite-topic", help="lite topics").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    describe = verb(lites, "describe", lambda c, a: c.describe_lite_topic(a.parent, a.lite), "show one")
    describe.add_argument("parent")
    describe.add_argument("lite")
    page = verb(
        lites,
        "list",
        lambda c, a: c.list_lite_topics(a.parent, start_after=a.start_after, limit=a.limit),
        "one page; the next: --start-after the key it prints below (-o json: next_start_after)",
    )
    page.add_argument("parent", nargs="?", default="")
    page.add_argument("--start-after", default="")
    page.add_argument("--limit", type=int, default=100)
    scan = verb(lites, "scan", None, "stream every lite topic in a key range")
    scan.set_defaults(scan=True)
    scan.add_argument("parent", nargs="?", default="")
    scan.add_argument("--start-after", default="")
    scan.add_argument("--end-before", default="")
    scan.add_argument("--batch-size", type=int, default=10_000)
    scan.add_argument("--with-subscribers", action="store_true")
    scan.add_argument("--with-fully-consumed", action="store_true")

    clients = resources.add_parser("clients", help="connected clients").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    verb(clients, "list", lambda c, a: c.list_clients(a.group), "list").add_argument("--group")

    broker = resources.add_parser("broker", help="the broker itself").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    info = verb(broker, "info", lambda c, a: c.broker_info(with_undrained=not a.skip_undrained), "counts and sizes")
    info.add_argument("--skip-undrained", action="store_true", help="skip the walk over every lite topic")

    backup_cli.add(resources)
    cluster = resources.add_parser("cluster", help="the brokers sharing the lite topics (scale-out)").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    get = verb(cluster, "get", lambda c, a: c.cluster(with_undrained=a.undrained), "membership as this broker has it")
    get.add_argument("--undrained", action="store_true", help="also count undrained messages (walks every lite topic)")
    change = verb(cluster, "set", _set_cluster, "change the membership while the brokers run")
    change.add_argument("--peers", required=True, help="every member's host:port in slot order, comma-separated")
    change.add_argument(
        "--ring-history", type=_sizes, default=(), help="earlier ring sizes, oldest first (as the serve flag)"
    )
    change.add_argument(
        "--ring-size", type=int, help="today's ring (default: every peer); members past it are leaving (scale-down)"
    )
    change.add_argument("--slot", type=int, help="this broker's slot (default: its endpoint among the peers)")
    change.add_argument("--force", action="store_true", help="remove members that are not known to be drained")
    change.add_argument(
        "--everywhere", action="store_true", help="apply to every broker of the old and new membership, in a safe order"
    )
    change.add_argument(
        "--admin-port",
        type=int,
        help="with --everywhere: the admin port at each member's host (default: the one --endpoint's broker reports, "
        "its --admin-port; none: each member's own endpoint)",
    )
    _lite_operations(resources, verb)
    return parser


# --- lite operations beyond mqadmin's lite commands -------------------------------------------------------
_RESETS: Final = {
    "min": OffsetPolicy.MIN,
    "max": OffsetPolicy.MAX,
    "offset": OffsetPolicy.OFFSET,
    "tail-n": OffsetPolicy.TAIL_N,
}


def _reset(admin: AdminClient, a: argparse.Namespace) -> object:
    offsets = admin.reset_lite_offsets(a.group, a.lites, OffsetReset(_RESETS[a.to], a.value))
    return [{"lite": lite, "offset": offsets.get(lite)} for lite in a.lites]


def _lite_operations(
    resources: argparse._SubParsersAction[argparse.ArgumentParser],
    verb: Callable[..., argparse.ArgumentParser],
) -> None:
    ops = resources.add_parser("lite", help="lite clients, group lag, offset resets, dispatch").add_subparsers(
        dest="verb", required=True, metavar="VERB"
    )
    verb(ops, "client", lambda c, a: c.get_lite_client(a.client_id), "a client's lite-topic set").add_argument(
        "client_id"
    )
    lag = verb(
        ops, "lag", lambda c, a: c.group_lag(a.group, top_k=a.top), "a group's lag, latency and top lagging lite topics"
    )
    lag.add_argument("group")
    lag.add_argument("--top", type=int, default=0, help="lite topics listed, largest lag first (default 10, max 1000)")
    reset = verb(ops, "reset-offset", _reset, "move a group's offset in lite topics of its bind topic")
    reset.add_argument("group")
    reset.add_argument("lites", nargs="+", metavar="LITE")
    reset.add_argument(
        "--to",
        choices=tuple(_RESETS),
        required=True,
        help="min: consume everything stored again; max: skip the backlog; offset: --value; "
        "tail-n: the last --value messages (only where the group has an offset)",
    )
    reset.add_argument("--value", type=int, default=0)
    dispatch = verb(
        ops,
        "dispatch",
        lambda c, a: [{"offered": lite} for lite in c.trigger_lite_dispatch(a.group, a.lites)],
        "offer lite topics' pending work to the group's subscribers now",
    )
    dispatch.add_argument("group")
    dispatch.add_argument("lites", nargs="*", metavar="LITE", help="default: every lite topic its clients subscribe to")


def _emit_group_lag(lag: GroupLag, out: TextIO) -> None:
    """The totals, then one row per lite topic of the top K."""
    summary = plain(lag)
    del summary["top"]
    print_table([summary], out)
    if lag.top:
        print(file=out)
        print_table([plain(t) for t in lag.top], out)


def _credentials_hint(pair: credentials.KeyPair | None, data_dir: Path | None) -> str:
    """One line: where lmq-admin looked for the admin key pair and what it found."""
    where = credentials.path_in(data_dir or Path(os.environ.get(DATA_DIR_ENV, "") or credentials.DEFAULT_DATA_DIR))
    used = f"signed with access key {pair.access_key}" if pair else f"sent unsigned (no {where})"
    return (
        f"{used}; lmq-admin takes the broker's admin pair from --access-key/--secret-key, else "
        f"{ACCESS_KEY_ENV}/{SECRET_KEY_ENV}, else --data-dir/{credentials.FILE_NAME} (the broker's data directory)"
    )


_OUTPUT_FLAGS: Final = ("-o", "--output")


def hoist_output(argv: Sequence[str]) -> list[str]:
    """``-o json`` may come anywhere (``lmq-admin group list -o json``): argparse takes it only before the
    resource, so every ``-o X`` / ``--output X`` / ``--output=X`` / ``-oX`` is moved to the front (the last
    one wins, as argparse would have it). Tokens after ``--`` are left where they are."""
    front: list[str] = []
    rest: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            rest.append(token)
            rest.extend(tokens)
            break
        if token in _OUTPUT_FLAGS:
            value = next(tokens, None)
            front += [token] if value is None else [token, value]  # no value: argparse reports the usage error
        elif token.startswith("--output="):
            front.append(token)
        elif token.startswith("-o") and len(token) > 2:
            front += ["-o", token[2:]]
        else:
            rest.append(token)
    return front + rest


def _has_port(endpoint: str) -> bool:
    """``host:port``, ``[v6]:port``, or a gRPC target with a scheme (``unix:``, ``dns:///host:port``)."""
    if "://" in endpoint or endpoint.startswith(("unix:", "unix-abstract:")):
        return True
    host, sep, port = endpoint.rpartition(":")
    return bool(sep and host and port.isdigit() and not host.endswith(":"))


def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        args = _parser().parse_args(hoist_output(sys.argv[1:] if argv is None else argv))
    except SystemExit as exit_:  # argparse exits on --help (0) and on bad usage (2)
        return int(exit_.code or 0)
    if getattr(args, "offline", None) is not None:  # restore: no broker to call
        try:
            emit(args.offline(args, err), args.output, out)
        except errors.LmqError as exc:
            print(f"error: {type(exc).__name__}: {exc.message}", file=err)
            return EXIT_FAILED
        return EXIT_OK
    try:
        pair = credentials.resolve(args.access_key, args.secret_key, args.data_dir)
        secured = tls.client_tls(args.tls_ca, args.tls_server_name)
    except errors.LmqError as exc:
        print(f"error: {exc.message}", file=err)
        return EXIT_USAGE
    if not _has_port(args.endpoint):
        print(f"error: --endpoint {args.endpoint} names no port (gRPC would dial 443): give host:port, e.g. "
              f"{args.endpoint.rstrip(':')}:8081", file=err)  # fmt: skip
        return EXIT_USAGE
    args.keys, args.tls, args.err = pair, secured, err
    client = AdminClient(
        args.endpoint, args.timeout, long_timeout_s=3600.0, keys=pair, tls=secured, here_only=args.here_only
    )
    try:
        if getattr(args, "scan", False):
            _scan(client, args, out)
        else:
            emit(args.run(client, args), args.output, out)
    except errors.LmqError as exc:
        print(f"error: {type(exc).__name__}: {exc.message}", file=err)
        if isinstance(exc, errors.Unauthorized):
            print(f"hint: {_credentials_hint(pair, args.data_dir)}", file=err)
        return EXIT_FAILED
    except BrokenPipeError:  # `lmq-admin ... | head`
        return EXIT_OK
    finally:
        client.close()
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
