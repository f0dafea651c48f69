"""Fixtures of the reclaim suite: a real local SparkSession per module, built the way the job builds its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import SparkSession

from lmq_reclaim import options, session


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkSession]:
    opts = options.Options(brokers=("unused:1",), master="local[1]", local_dir=tmp_path_factory.mktemp("spark"))
    active = session.build(opts)
    yield active
    active.stop()
