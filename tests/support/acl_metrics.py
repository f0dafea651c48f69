"""A broker's count of access-control refusals, read from its metrics (no protobuf here: the official clients'
tests load their own copy of the v2 protos, which lmq's generated ones would clash with)."""

from __future__ import annotations

import re
import urllib.request


def acl_refused(metrics_url: str, user: str, action: str) -> float:
    """``lmq_acl_refused_total{user,action}`` of the broker serving ``metrics_url`` (0 before the first)."""
    with urllib.request.urlopen(f"{metrics_url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    found = re.search(rf'^lmq_acl_refused_total\{{action="{action}",user="{user}"\}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0
