"""A send looks at its lite topics only when some lite-topic limit exists (decided once per snapshot)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmq_broker import errors, model
from lmq_broker.dispatch import metadata, quotas
from lmq_broker.dispatch.testing import config_for, lite_message
from lmq_broker.storage import memory

PARENT = model.ParentTopic("P")


def test_no_limit_anywhere_means_no_check(tmp_path: Path) -> None:
    snap = metadata.Metadata(config_for(tmp_path), {"P": PARENT}, {}, {"namespace:n": model.Quota("namespace:n")})
    assert not snap.limits_lite_topics
    assert quotas.lite_topic_check(memory.MemoryStore(), snap, [lite_message("a")]) is None


@pytest.mark.parametrize(
    ("overrides", "parents", "quotas_by_scope"),
    [
        ({"max_lite_topics_per_broker": 0}, {"P": PARENT}, {}),
        ({}, {"P": model.ParentTopic("P", max_lite_topics=0)}, {}),
        ({}, {"P": PARENT}, {"broker": model.Quota("broker", max_lite_topics=0)}),
        ({}, {"P": PARENT}, {"parent:P": model.Quota("parent:P", max_lite_topics=0)}),
    ],
)
def test_any_limit_is_enforced(
    tmp_path: Path,
    overrides: dict[str, object],
    parents: dict[str, model.ParentTopic],
    quotas_by_scope: dict[str, model.Quota],
) -> None:
    snap = metadata.Metadata(config_for(tmp_path, **overrides), parents, {}, quotas_by_scope)
    assert snap.limits_lite_topics
    check = quotas.lite_topic_check(memory.MemoryStore(), snap, [lite_message("a")])
    assert check is not None
    with pytest.raises(errors.LiteTopicQuotaExceeded):
        check()
