"""The CRDs are generated from the operator's models into crds/ and the chart (drift-checked by
scripts/gen_crds.py), they are valid apiextensions/v1 objects, and the example resources in
charts/lmq/examples/ fit their CRD's schema.

Kubernetes validates custom resources against the CRD's openAPIV3Schema and (with kubectl's default
strict field validation) refuses unknown fields, so the examples are checked against the schema with
every described object closed. CEL rules (x-kubernetes-validations) need an API server; they are not
evaluated here.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from lmq_broker.access import policy

Manifest = dict[str, Any]
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
GENERATED = ("crds", "charts/lmq/crds", "docs/operator.md")


def run_gen(repo_root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(repo_root / "scripts" / "gen_crds.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_committed_crds_and_docs_are_what_the_models_generate(repo_root: Path) -> None:
    result = run_gen(repo_root, "--check")
    assert result.returncode == 0, result.stderr
    assert "in sync" in result.stdout


def test_drift_is_reported_and_repaired(repo_root: Path, tmp_path: Path) -> None:
    for relative in GENERATED:
        source, copy_ = repo_root / relative, tmp_path / relative
        if source.is_dir():
            shutil.copytree(source, copy_)
        else:
            copy_.parent.mkdir(parents=True)
            shutil.copy(source, copy_)
    sources, chart_crds = tmp_path / "crds", tmp_path / "charts" / "lmq" / "crds"
    first, second, *_ = sorted(p.name for p in chart_crds.glob("*.yaml"))
    (chart_crds / first).write_text((chart_crds / first).read_text() + "# edited in the chart\n")
    (chart_crds / second).unlink()
    (chart_crds / "old.lmq.io.yaml").write_text("kind: CustomResourceDefinition\n")
    edited_source = sources / second
    edited_source.write_text(edited_source.read_text().replace("maxLength: 127", "maxLength: 253"))
    docs = tmp_path / "docs" / "operator.md"
    docs.write_text(docs.read_text().replace("| `readySetCapacity` |", "| `readyCapacity` |"))

    drifted = run_gen(repo_root, "--check", "--root", str(tmp_path))
    assert drifted.returncode == 1
    assert f"differs from what the models generate: charts/lmq/crds/{first}" in drifted.stderr
    assert f"missing: charts/lmq/crds/{second}" in drifted.stderr
    assert "stale (not generated): charts/lmq/crds/old.lmq.io.yaml" in drifted.stderr
    assert f"differs from what the models generate: crds/{second}" in drifted.stderr
    assert "differs from what the models generate: docs/operator.md" in drifted.stderr

    repaired = run_gen(repo_root, "--root", str(tmp_path))
    assert repaired.returncode == 0, repaired.stderr
    assert run_gen(repo_root, "--check", "--root", str(tmp_path)).returncode == 0
    for relative in GENERATED:
        if (repo_root / relative).is_dir():
            committed = {p.name: p.read_bytes() for p in (repo_root / relative).glob("*.yaml")}
            assert {p.name: p.read_bytes() for p in (tmp_path / relative).glob("*.yaml")} == committed
        else:
            assert (tmp_path / relative).read_bytes() == (repo_root / relative).read_bytes()


def test_check_fails_outside_a_checkout(repo_root: Path, tmp_path: Path) -> None:
    result = run_gen(repo_root, "--check", "--root", str(tmp_path))
    assert result.returncode == 2
    assert "no docs/operator.md" in result.stderr


def test_helm_installs_exactly_the_source_crds(chart: helm.Chart, repo_root: Path) -> None:
    shipped = {Path(c["filename"]).name: c["data"] for c in chart.crds}
    sources = {p.name: p.read_text() for p in (repo_root / "crds").glob("*.yaml")}
    assert shipped.keys() == sources.keys()
    for name, text in sources.items():
        assert yaml.safe_load(shipped[name]) == yaml.safe_load(text)


def test_crds_are_valid_and_name_the_agreed_resources(crds: dict[str, Manifest], kube_version: str) -> None:
    assert set(crds) == {"ParentTopic", "LiteGroup", "LiteQuota", "LmqUser"}
    for kind, crd in crds.items():
        kubernetes_validate.validate(crd, kube_version, strict=True)
        spec = crd["spec"]
        assert spec["group"] == "lmq.io"
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.lmq.io"
        assert spec["names"]["kind"] == kind
        (version,) = spec["versions"]
        assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
        assert version["subresources"] == {"status": {}}  # status writes never bump generation


# CEL functions of the Kubernetes libraries that a CRD may use only from some Kubernetes version on (a library
# is offered to new expressions one minor after the one that introduced it); the rest are older than 1.29.
CEL_FROM: dict[str, tuple[int, int]] = {"isIP": (1, 31), "isCIDR": (1, 31), "ip": (1, 31), "cidr": (1, 31)}


def _rules(node: Any) -> list[str]:
    if isinstance(node, dict):
        rules = node.get("x-kubernetes-validations", ())
        own = [str(r.get(k, "")) for r in rules for k in ("rule", "messageExpression")]
        return own + [x for value in node.values() for x in _rules(value)]
    if isinstance(node, list):
        return [x for value in node for x in _rules(value)]
    return []


def test_the_chart_asks_for_a_kubernetes_whose_cel_has_every_function_the_crds_call(
    crds: dict[str, Manifest], chart_dir: Path
) -> None:
    """An apiserver older than a CEL function the CRD calls refuses the whole CRD (LmqUser's isCIDR/isIP:
    1.31), so `helm install` on the Kubernetes the chart claimed (1.29) failed at its CRDs."""
    text = "\n".join(rule for crd in crds.values() for rule in _rules(crd))
    needed = max([v for name, v in CEL_FROM.items() if re.search(rf"\b{name}\(", text)], default=(1, 29))
    chart = yaml.safe_load((chart_dir / "Chart.yaml").read_text())
    claimed = re.fullmatch(r">=(\d+)\.(\d+)\.0-0", chart["kubeVersion"])
    assert claimed is not None
    assert (int(claimed.group(1)), int(claimed.group(2))) >= needed
    readme = (chart_dir / "README.md").read_text()
    assert f"on Kubernetes ≥ {claimed.group(1)}.{claimed.group(2)}:" in readme


def test_every_kind_has_an_example(crds: dict[str, Manifest], examples: list[tuple[str, Manifest]]) -> None:
    assert {doc["kind"] for _, doc in examples} == set(crds)


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with every described object closed, like the API server's strict field validation.

    metadata is left open (the API server validates it on its own) and so is anything that declares
    x-kubernetes-preserve-unknown-fields.
    """
    schema = copy.deepcopy(schema)

    def close(node: dict[str, Any], key: str) -> None:
        if "properties" in node and key != "metadata" and not node.get("x-kubernetes-preserve-unknown-fields"):
            node.setdefault("additionalProperties", False)
        for child_key, child in node.get("properties", {}).items():
            close(child, child_key)
        if isinstance(node.get("items"), dict):
            close(node["items"], "items")

    close(schema, "")
    return schema


@pytest.fixture(scope="module")
def validators(crds: dict[str, Manifest]) -> dict[str, jsonschema.protocols.Validator]:
    built: dict[str, jsonschema.protocols.Validator] = {}
    for kind, crd in crds.items():
        schema = closed(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        validator_class = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
        validator_class.check_schema(schema)
        built[kind] = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    return built


@pytest.fixture(scope="module")
def examples(chart_dir: Path) -> list[tuple[str, Manifest]]:
    found = [
        (f"{path.name}#{index}", doc)
        for path in sorted((chart_dir / "examples").glob("*.yaml"))
        for index, doc in enumerate(yaml.safe_load_all(path.read_text()))
        if doc
    ]
    assert found, "no examples in charts/lmq/examples/"
    return found


def test_examples_fit_their_crd(
    examples: list[tuple[str, Manifest]],
    crds: dict[str, Manifest],
    validators: dict[str, jsonschema.protocols.Validator],
) -> None:
    for where, doc in examples:
        assert doc["apiVersion"] == "lmq.io/v1alpha1", where
        crd = crds[doc["kind"]]
        errors = [
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validators[doc["kind"]].iter_errors(doc)
        ]
        assert errors == [], where
        assert jsonschema.Draft7Validator({"pattern": DNS_SUBDOMAIN, "maxLength": 253}).is_valid(
            doc["metadata"]["name"]
        ), where
        assert crd["spec"]["scope"] == "Namespaced" and "namespace" not in doc["metadata"], (
            f"{where}: examples are applied with -n <namespace>"
        )


def test_examples_agree_with_each_other(examples: list[tuple[str, Manifest]]) -> None:
    # The NOTES quick start applies them together: the group and the quota name the example parent topic.
    parents = {
        doc["spec"].get("topicName", doc["metadata"]["name"]) for _, doc in examples if doc["kind"] == "ParentTopic"
    }
    for where, doc in examples:
        if doc["kind"] == "LiteGroup" or (doc["kind"] == "LiteQuota" and "parentTopic" in doc["spec"]):
            assert doc["spec"]["parentTopic"] in parents, where
        for rule in doc["spec"].get("policies", ()) if doc["kind"] == "LmqUser" else ():
            for resource in rule["resources"]:
                if resource.startswith("Lite:"):
                    assert resource.removeprefix("Lite:").partition("/")[0] in parents, where


def test_the_tenant_example_confines_its_user_to_its_own_lite_topics(examples: list[tuple[str, Manifest]]) -> None:
    """The broker's own policy evaluator, on the example's policies: tenant A reaches tenant-a-* only."""
    (user,) = [doc for _, doc in examples if doc["kind"] == "LmqUser"]
    name = user["metadata"]["name"]
    entries = [
        policy.checked_entry(
            policy.Entry(
                name,
                r,
                tuple(policy.action_of(a) for a in p["actions"]),
                policy.decision_of(p.get("decision", "Allow")),
            )
        )
        for p in user["spec"]["policies"]
        for r in p["resources"]
    ]
    subject = policy.compile_rules([policy.User(name, "x" * 16)], entries).subject(name)
    assert subject is not None
    parent = "agent-replies"
    for action in (policy.Action.PUB, policy.Action.SUB):
        assert subject.allows(action, policy.lite(parent, "tenant-a-session-1"))
        assert not subject.allows(action, policy.lite(parent, "tenant-b-session-1"))
        assert not subject.allows(action, policy.topic(parent))  # not every lite topic of the parent
    assert subject.allows(policy.Action.SUB, policy.group("tenant-a-workers"))
    assert not subject.allows(policy.Action.SUB, policy.group("tenant-b-workers"))
    assert not subject.allows(policy.Action.DELETE, policy.lite(parent, "tenant-a-session-1"))
    assert set(user["spec"]["secretRef"]) == {"name", "key"}  # the secret itself is never in the spec


BROKEN: list[tuple[str, Callable[[Manifest], None]]] = [
    ("ParentTopic", lambda d: d["spec"].update(messageType="NORMAL")),
    ("ParentTopic", lambda d: d["spec"].update(liteTopicExpirationMinutes="1d")),
    ("ParentTopic", lambda d: d["spec"].update(expirationMinutes=60)),
    ("ParentTopic", lambda d: d["spec"].update(deletionPolicy="Orphan")),
    ("LiteGroup", lambda d: d["spec"].pop("parentTopic")),
    ("LiteGroup", lambda d: d["spec"].update(subscriptionModel="shared")),
    ("LiteGroup", lambda d: d["spec"].update(clientSubscriptionQuota=0)),
    ("LiteGroup", lambda d: d["spec"]["retryPolicy"].update(maxAttempts="5")),
    ("LiteGroup", lambda d: d["spec"]["retryPolicy"].update(backof=["1s"])),
    ("LiteQuota", lambda d: d["spec"].update(maxSendRate="fast")),
    ("LiteQuota", lambda d: d.pop("spec")),
    ("LmqUser", lambda d: d["spec"].pop("secretRef")),
    ("LmqUser", lambda d: d["spec"].update(secret="in-the-spec")),  # never: a Secret holds it
    ("LmqUser", lambda d: d["spec"]["policies"][0].update(actions=["Publish"])),
    ("LmqUser", lambda d: d["spec"]["policies"][0].update(decision="allow")),
    ("LmqUser", lambda d: d["spec"]["policies"][0].update(resources=[])),
]


@pytest.mark.parametrize(("kind", "breaks"), BROKEN, ids=[f"{k}-{i}" for i, (k, _) in enumerate(BROKEN)])
def test_a_broken_example_is_refused(
    examples: list[tuple[str, Manifest]],
    validators: dict[str, jsonschema.protocols.Validator],
    kind: str,
    breaks: Callable[[Manifest], None],
) -> None:
    doc = copy.deepcopy(next(doc for _, doc in examples if doc["kind"] == kind))
    assert validators[kind].is_valid(doc)
    breaks(doc)
    assert not validators[kind].is_valid(doc)


def test_the_readme_tells_the_crd_upgrade_story(chart_dir: Path) -> None:
    readme = (chart_dir / "README.md").read_text()
    apply_at = readme.index("kubectl apply --server-side -f charts/lmq/crds/")
    assert apply_at < readme.index("helm upgrade mq charts/lmq")  # CRDs first, then the release
    assert "never upgrades or deletes them" in readme
    assert "Never `kubectl replace --force`" in readme


def test_the_readme_deletes_the_resources_before_the_operator_and_the_crds(chart_dir: Path) -> None:
    """Resources keep lmq.io/finalizer until the running operator has deleted their broker copies."""
    readme = (chart_dir / "README.md").read_text()
    delete_at = readme.index("kubectl delete lmqusers,parenttopics,litegroups,litequotas --all -A")
    assert delete_at < readme.index("helm uninstall mq -n mq") < readme.index("kubectl delete crd parenttopics.lmq.io")
    assert "lmq.io/finalizer" in readme and "Terminating" in readme
