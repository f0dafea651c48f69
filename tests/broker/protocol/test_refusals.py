"""Refusals a client caused are logged at INFO, once a minute per kind, with no secret."""

from __future__ import annotations

import logging

import pytest

from lmq_broker.protocol.gen.apache.rocketmq.v2 import definition_pb2 as pb
from lmq_broker.protocol.gen.apache.rocketmq.v2 import service_pb2 as spb
from lmq_broker.protocol.refusals import EVERY_S, MAX_KEYS, RefusalLog
from lmq_broker.protocol.testing import Client

HEADERS = (("x-mq-client-id", "newcomer@1"), ("x-mq-language", "PYTHON"), ("x-mq-client-version", "5.1.2"))


def test_one_line_per_kind_per_minute_with_the_repeats_counted(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    refusals = RefusalLog(lambda: now[0])
    with caplog.at_level(logging.INFO, logger="lmq_broker.refused"):
        assert refusals.note("QueryRoute", 40402, "topic NOPE does not exist")
        assert not refusals.note("QueryRoute", 40402, "topic NOPE does not exist")
        assert not refusals.note("QueryRoute", 40402, "topic NOPE does not exist")
        assert refusals.note("QueryRoute", 40402, "topic OTHER does not exist")
        now[0] += EVERY_S
        assert refusals.note("QueryRoute", 40402, "topic NOPE does not exist")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused QueryRoute: 40402 topic NOPE does not exist",
        "refused QueryRoute: 40402 topic OTHER does not exist",
        "refused QueryRoute: 40402 topic NOPE does not exist (and 2 more like it in the last minute)",
    ]


def test_distinct_refusals_kept_are_bounded() -> None:
    refusals = RefusalLog(lambda: 0.0)
    for i in range(3 * MAX_KEYS):
        refusals.note("QueryRoute", 40402, f"topic T{i} does not exist")
    assert len(refusals._last) <= MAX_KEYS


@pytest.mark.asyncio
async def test_a_route_for_an_unknown_parent_is_logged_at_info(
    client: Client, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="lmq_broker.refused"):
        request = spb.QueryRouteRequest(topic=pb.Resource(name="NO_SUCH_PARENT"))
        reply = await client.stub.QueryRoute(request, metadata=HEADERS)
    assert reply.status.code == pb.TOPIC_NOT_FOUND
    assert any("refused QueryRoute: 40402" in r.getMessage() and "NO_SUCH_PARENT" in r.getMessage()
               for r in caplog.records)  # fmt: skip
