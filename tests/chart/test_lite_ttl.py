"""Expiry defaults of the chart: the reclaim CronJob (the bulk path) is on by default, and so is every broker's
own expiry (``broker.liteTtl``), whose values become the broker's flags only when set."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import helm_python as helm
import pytest

from lmq_broker import __main__ as broker_main
from lmq_broker.config import BrokerConfig

Manifest = dict[str, Any]
Render = Callable[..., list[Manifest]]
One = Callable[..., Manifest]
BROKER = "demo-lmq-broker"


def broker_args(render: Render, one: One, lite_ttl: dict[str, Any] | None = None) -> list[str]:
    values = {"broker": {"liteTtl": lite_ttl}} if lite_ttl is not None else {}
    sts = one(render(values), "StatefulSet", BROKER)
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args: list[str] = container["args"]
    return args


def ttl_flags(args: list[str]) -> list[str]:
    at = [i for i, arg in enumerate(args) if arg.startswith("--lite-ttl-")]
    return [part for i in at for part in args[i : i + 2]]


def broker_config(args: list[str]) -> BrokerConfig:
    """What the broker makes of the rendered command line (its own parser; no LMQ_* variable of ours leaks in)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("LMQ_")}
    return broker_main.config_from(broker_main.build_parser().parse_args(args), environ)


def test_by_default_the_reclaim_cronjob_runs_and_brokers_expire_with_their_own_defaults(
    render: Render, one: One
) -> None:
    objects = render()
    assert one(objects, "CronJob", "demo-lmq-reclaim")["spec"]["schedule"]
    args = broker_args(render, one)
    assert ttl_flags(args) == []  # the broker's defaults hold, and they have the expiry on
    config = broker_config(args)
    assert (config.lite_ttl_interval_ms, config.lite_ttl_batch, config.lite_ttl_min_age_ms) == (120_000, 1000, 900_000)
    assert config.lite_ttl_step_pause_ms == BrokerConfig().lite_ttl_step_pause_ms


def test_turning_the_broker_expiry_off_renders_interval_zero(render: Render, one: One) -> None:
    args = broker_args(render, one, {"enabled": False, "intervalMs": 5000})
    assert ttl_flags(args) == ["--lite-ttl-interval-ms", "0"]
    assert broker_config(args).lite_ttl_interval_ms == 0


def test_each_value_becomes_the_brokers_flag_and_zero_is_a_value(render: Render, one: One) -> None:
    values = {"intervalMs": 60_000, "batch": 500, "stepPauseMs": 0, "minAgeMs": 1_800_000}
    args = broker_args(render, one, values)
    assert ttl_flags(args) == [
        "--lite-ttl-batch", "500", "--lite-ttl-interval-ms", "60000", "--lite-ttl-min-age-ms", "1800000",
        "--lite-ttl-step-pause-ms", "0",
    ]  # fmt: skip
    config = broker_config(args)
    assert (
        config.lite_ttl_interval_ms,
        config.lite_ttl_batch,
        config.lite_ttl_step_pause_ms,
        config.lite_ttl_min_age_ms,
    ) == (60_000, 500, 0, 1_800_000)
    assert args.index("--lite-ttl-batch") < args.index("--no-bootstrap") + 3  # before extraArgs, which may override


@pytest.mark.parametrize(("share", "rendered"), [(0.01, "0.01"), (0, "0")])
def test_the_cpu_share_becomes_the_brokers_flag_as_a_number(
    render: Render, one: One, share: float, rendered: str
) -> None:
    args = broker_args(render, one, {"cpuShare": share})
    assert ttl_flags(args) == ["--lite-ttl-cpu-share", rendered]
    assert broker_config(args).lite_ttl_cpu_share == share


@pytest.mark.parametrize(
    ("lite_ttl", "where"),
    [
        ({"batch": 0}, "batch"),
        ({"batch": 200_000}, "batch"),
        ({"intervalMs": 0}, "intervalMs"),  # off is enabled: false
        ({"minAgeMs": -1}, "minAgeMs"),
        ({"cpuShare": 2}, "cpuShare"),
        ({"stepPauseMs": "20"}, "stepPauseMs"),
        ({"enabled": "yes"}, "enabled"),
        ({"interval": 1000}, "interval"),
    ],
)
def test_bad_lite_ttl_values_are_refused(chart: helm.Chart, lite_ttl: dict[str, Any], where: str) -> None:
    broker = chart.values["broker"]
    values = {**chart.values, "broker": {**broker, "liteTtl": {**broker["liteTtl"], **lite_ttl}}}
    with pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(values)
