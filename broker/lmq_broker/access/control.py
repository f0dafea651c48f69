"""The broker's live access control: the compiled rules, a bounded decision cache, the refusal counts.

One per broker process, shared by the v2 service, the MQTT listener and the admin service (which calls
``load`` after every change, so a change applies to the next call: no restart, no reconnect). A decision is
cached by (user, action, target, source when that user's rules name networks); ``load`` replaces the rules
and drops the cache in one step, so no answer outlives the rules it came from. The cache holds at most
``--acl-cache-entries`` answers and is emptied when full (answers are cheap to recompute; a bounded dict keeps
the hit path one lookup: the answers of a user whose rules name no networks are keyed with no source, so a hit
is found before the user's rules are even looked up).

The admin key pair is a super user that no document can change or remove: whoever administers the broker
may also send and receive, and brokers of a cluster sign the calls they make to each other with it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Final

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector as _Collector

from lmq_broker import errors
from lmq_broker.access import document, policy

log = logging.getLogger("lmq_broker.refused")

CACHE_ENTRIES: Final = 65_536  # the default of --acl-cache-entries
LOG_EVERY_S: Final = 60.0
LOG_KEYS_MAX: Final = 1024
ANONYMOUS: Final = "(anonymous)"  # a call with no user (ACL on, no signature: only when auth let it through)

CacheKey = tuple[str, policy.Action, policy.Target, policy.IpAddress | None]


class AccessControl:
    def __init__(
        self,
        enabled: bool,
        super_keys: tuple[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        cache_entries: int = CACHE_ENTRIES,
    ) -> None:
        self.enabled = enabled
        self._cache_entries = cache_entries
        self._super = (
            None
            if super_keys is None or not super_keys[0]
            else policy.Subject(policy.User(super_keys[0], super_keys[1], super_user=True), (), False)
        )
        self.doc = document.Document()
        # The rules and the answers they gave, swapped together (``load`` may run in a worker thread while the
        # event loop decides): an answer of old rules can only land in the old cache, which is dropped.
        self._state: tuple[policy.Rules, dict[CacheKey, bool]] = (policy.Rules(), {})
        self.refused: Counter[tuple[str, str]] = Counter()  # (user, action) -> refusals
        self.generation = 0  # bumped by every load
        self._clock = clock
        self._logged: dict[tuple[str, str, str], tuple[float, int]] = {}
        self._watchers: list[Callable[[], object]] = []

    def load(self, doc: document.Document) -> None:
        self._state = (doc.rules(), {})
        self.doc = doc
        self.generation += 1  # after the swap: whoever remembers answers by generation drops them then
        for changed in list(self._watchers):
            changed()

    def watch(self, changed: Callable[[], object]) -> None:
        """Call ``changed()`` after every ``load`` (a user or policy change): whoever holds what was allowed
        before (subscriptions) checks it again. It may be called from a worker thread: hand it to your loop."""
        self._watchers.append(changed)

    def unwatch(self, changed: Callable[[], object]) -> None:
        if changed in self._watchers:
            self._watchers.remove(changed)

    def _subject(self, name: str, rules: policy.Rules | None = None) -> policy.Subject | None:
        if self._super is not None and name == self._super.user.name:
            return self._super
        return (rules or self._state[0]).subject(name)

    def secret_of(self, name: str) -> str | None:
        """The secret a signature or an MQTT password of ``name`` must match; None: no such enabled user."""
        subject = self._subject(name)
        return subject.user.secret if subject is not None and subject.user.enabled else None

    def allows(self, user: str, action: policy.Action, target: policy.Target, peer: str = "") -> bool:
        rules, cache = self._state
        found = cache.get((user, action, target, None))
        if found is not None:  # only a user whose rules name no networks has answers keyed without a source
            return found
        subject = self._subject(user, rules)
        if subject is None:
            return False
        source = policy.source_of(peer) if subject.by_source else None
        key = (user, action, target, source)
        found = cache.get(key)
        if found is None:
            found = subject.allows(action, target, source)
            if len(cache) >= self._cache_entries:
                cache.clear()
            if self._cache_entries:
                cache[key] = found
        return found

    def by_source(self, user: str) -> bool:
        """Whether ``user``'s decisions depend on the caller's address (some rule names networks)."""
        subject = self._subject(user)
        return subject is not None and subject.by_source

    @property
    def cached(self) -> int:
        """Decisions remembered now."""
        return len(self._state[1])

    def check(self, user: str, action: policy.Action, target: policy.Target, peer: str = "") -> None:
        """Raise ``errors.Forbidden`` (counted) unless ``user`` may do ``action`` on ``target``; a no-op with
        access control off."""
        if self.enabled and not self.allows(user, action, target, peer):
            raise self.refusal(user, action, target)

    def is_super(self, user: str) -> bool:
        """The admin pair's user, or an enabled user marked super."""
        subject = self._subject(user)
        return subject is not None and subject.user.super_user and subject.user.enabled

    def count_refusal(self, user: str, action: policy.Action) -> str:
        """Count a refusal in ``lmq_acl_refused_total``; the name it is counted under (no label per made-up
        name: ``ANONYMOUS``)."""
        name = user if self._subject(user) is not None else ANONYMOUS
        self.refused[(name, action.value)] += 1
        return name

    def refusal(self, user: str, action: policy.Action, target: policy.Target) -> errors.Forbidden:
        """The error a refused call raises, counted in ``lmq_acl_refused_total``."""
        name = self.count_refusal(user, action)
        return errors.Forbidden(
            f"user {name} may not {action.value} on {target} (access control; see lmq-admin acl get {name})",
            kind="acl",
            user=name,
            action=action.value,
        )

    def note(self, where: str, message: str) -> None:
        """Log a refusal at INFO, one line per distinct refusal per minute with the repeats since (no secret: the
        message names the user, the action and the resource only). For callers without a log of their own."""
        now = self._clock()
        key = (where, message, "")
        seen = self._logged.get(key)
        if seen is not None and now - seen[0] < LOG_EVERY_S:
            self._logged[key] = (seen[0], seen[1] + 1)
            return
        if seen is None and len(self._logged) >= LOG_KEYS_MAX:
            self._logged.clear()
        repeats = f" (and {seen[1]} more like it in the last minute)" if seen is not None and seen[1] else ""
        log.info("refused %s: %s%s", where, message, repeats)
        self._logged[key] = (now, 0)


class Collector(_Collector):
    """``lmq_acl_refused_total{user,action}``, read from the broker's ``AccessControl``."""

    def __init__(self, access: AccessControl) -> None:
        self._access = access

    def collect(self) -> Iterator[CounterMetricFamily]:
        refused = CounterMetricFamily(
            "lmq_acl_refused",
            "Calls and MQTT packets refused by access control, by user and action",
            labels=["user", "action"],
        )
        for (user, action), count in sorted(self._access.refused.items()):
            refused.add_metric([user, action], count)
        yield refused
