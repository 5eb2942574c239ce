"""Every rendered object, and the KServe manifests, validated strictly: built-in kinds against the
Kubernetes schemas of named releases (kubernetes-validate), custom resources against the CRDs
their projects publish (vendored in crds/, see its README); `helm lint --strict`; `helm package`
keeps the linked rules and dashboard; checkov finds nothing that is not skipped with a reason."""

from __future__ import annotations

import copy
import json
import subprocess

import yaml

from tests.deploy.conftest import (
    CHART,
    CRDS,
    DEPLOY_VENV,
    KSERVE,
    KUBE_VERSIONS,
    NAMESPACE,
    RELEASE,
    ROOT,
    documents,
    one,
    run_tool,
    value_sets,
)

CUSTOM = {"ServiceMonitor", "PrometheusRule", "ServingRuntime", "InferenceService"}
# checkov checks the chart skips (annotation checkov.io/skipN on the workload, with the reason)
SKIPPED = {
    "CKV_K8S_43": "image digest: a value (image.digest); the chart cannot know the digest of an image you build",
    "CKV_K8S_15": "pull policy Always: tags are fixed; Always would make every start depend on the registry",
    "CKV_K8S_40": "uid > 10000: the NGC image's own user is uid 1000 (Redis: 999)",
    "CKV_K8S_35": "secrets as files: tritonguard reads its keys from environment variables",
}


def _kserve_objects() -> list[dict]:
    out = []
    for path in sorted(KSERVE.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append({"where": f"deploy/kserve/{path.name}", "object": doc})
    return out


def test_kube_versions_include_the_charts_floor():
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    assert floor == f">={KUBE_VERSIONS[0]}.0-0"


def test_every_rendered_object_is_valid(docs):
    objects = [{"where": f"{label}: {template}", "object": obj}
               for label, d in docs.items() for template, obj in d]
    objects += _kserve_objects()
    results = run_tool("validate", objects=objects, kube_versions=list(KUBE_VERSIONS), crds=str(CRDS))
    assert len(results) == len(objects) * len(KUBE_VERSIONS)
    bad = [r for r in results if r["errors"]]
    assert not bad, "\n".join(f"{r['where']} {r['kind']}/{r['name']} (k8s {r['kube_version']}, {r['validator']}): "
                              f"{r['errors'][:3]}" for r in bad[:20])
    by = {(r["kind"], r["validator"]) for r in results}
    # custom resources were checked against their CRDs, everything else against Kubernetes' schemas
    assert {k for k, v in by if v == "crd"} == CUSTOM
    assert all(v == "kubernetes-validate" for k, v in by if k not in CUSTOM)
    kinds = {r["kind"] for r in results}
    assert {"Deployment", "StatefulSet", "Service", "Secret", "ConfigMap", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "Job", "NetworkPolicy", "PersistentVolumeClaim", "ServiceAccount"} <= kinds
    print(f"{len(objects)} objects x Kubernetes {', '.join(KUBE_VERSIONS)}: all valid")


def test_the_validators_refuse_broken_objects(docs):
    """Each validator fails on a mistake of the kind a chart makes (it is not a rubber stamp)."""
    d = docs["default"]
    broken = []
    dep = copy.deepcopy(one(d, "Deployment"))
    dep["spec"]["template"]["spec"]["containers"][0]["startupprobe"] = dep["spec"]["template"]["spec"][
        "containers"][0].pop("startupProbe")
    broken.append(("misspelt field", dep, "startupprobe"))
    svc = copy.deepcopy(one(d, "Service", f"{RELEASE}-tritonguard"))
    svc["spec"]["ports"][0]["port"] = "8000"
    broken.append(("port as a string", svc, "8000"))
    sm = copy.deepcopy(one(d, "ServiceMonitor"))
    sm["spec"]["endpoint"] = sm["spec"].pop("endpoints")
    broken.append(("ServiceMonitor field that does not exist", sm, "endpoint"))
    rule = copy.deepcopy(one(d, "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["for"] = 5
    broken.append(("PrometheusRule `for` as a number", rule, "for"))
    rule = copy.deepcopy(one(d, "PrometheusRule"))
    rule["metadata"]["labels"]["bad"] = {"nested": True}
    broken.append(("a label that is not a string", rule, "labels"))
    isvc = copy.deepcopy([o["object"] for o in _kserve_objects() if o["object"]["kind"] == "InferenceService"][0])
    isvc["spec"]["predictor"]["model"]["storageURI"] = isvc["spec"]["predictor"]["model"].pop("storageUri")
    broken.append(("InferenceService storageURI", isvc, "storageURI"))
    results = run_tool("validate", objects=[{"where": why, "object": obj} for why, obj, _ in broken],
                       kube_versions=[KUBE_VERSIONS[0]], crds=str(CRDS))
    for (why, _, needle), result in zip(broken, results, strict=True):
        assert result["errors"], f"{why}: passed validation"
        assert needle in " ".join(result["errors"]), (why, result["errors"])


def test_helm_lint_strict():
    reports = run_tool("lint", chart=str(CHART), namespace=NAMESPACE, kube_version=f"v{KUBE_VERSIONS[0]}.0",
                       sets=value_sets())
    for label, report in reports.items():
        # severity 1 is information ("icon is recommended"); 2 warning, 3 error
        serious = [m for m in report["messages"] if m["severity"] >= 2]
        assert not serious and not report["errors"], (label, serious, report["errors"])


def test_packaged_chart_carries_the_linked_rules_and_dashboard(tmp_path):
    """`helm package` follows the links in files/: the archive holds the files' contents."""
    answer = run_tool("package", chart=str(CHART), dest=str(tmp_path), name=RELEASE, namespace=NAMESPACE)
    assert answer["archive"].endswith(".tgz")
    assert answer["files"]["files/rules.yml"] == (ROOT / "deploy" / "prometheus" / "rules.yml").read_text()
    assert answer["files"]["files/tritonguard.json"] == (ROOT / "deploy" / "grafana" / "tritonguard.json").read_text()
    assert not any(name.startswith("examples/") for name in answer["files"]), "examples/ should be helmignored"
    rule = one(documents(answer["manifests"]), "PrometheusRule")
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules.yml").read_text())["groups"]


def test_checkov_finds_nothing_unexplained(rendered, tmp_path):
    for label, manifests in rendered.items():
        folder = tmp_path / label.replace("/", "_")
        folder.mkdir()
        for template, text in manifests.items():
            if template.endswith(".yaml") and text.strip():
                (folder / template.rsplit("/", 1)[-1]).write_text(text)
    for path in sorted(KSERVE.glob("*.yaml")):
        (tmp_path / f"kserve_{path.name}").write_text(path.read_text())
    proc = subprocess.run([str(DEPLOY_VENV / "bin" / "checkov"), "-d", str(tmp_path), "--framework", "kubernetes",
                           "--output", "json", "--skip-download"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.stdout.strip(), proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    report = report if isinstance(report, dict) else next(r for r in report if r["check_type"] == "kubernetes")
    summary = report["summary"]
    failed = report["results"]["failed_checks"]
    assert not failed, "\n".join(f"{c['check_id']} {c['check_name']}: {c['file_path']} {c['resource']}"
                                 for c in failed)
    assert summary["parsing_errors"] == 0
    # every rendered workload was scanned (a file checkov cannot parse is silently left out)
    scanned = {c["resource"].split(".")[0] for c in report["results"]["passed_checks"]}
    assert {"Deployment", "StatefulSet", "Job", "Service", "Secret"} <= scanned
    skipped = report["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} <= set(SKIPPED), "a skip that the tests do not list"
    assert all(c["check_result"].get("suppress_comment", "").strip() for c in skipped), "a skip without a reason"
    print(f"checkov {summary['checkov_version']}: {summary['passed']} passed, {summary['failed']} failed, "
          f"{summary['skipped']} skipped ({', '.join(sorted({c['check_id'] for c in skipped}))}), "
          f"{summary['resource_count']} resources")


def test_vendored_crds_are_the_upstream_files_named_in_the_readme():
    import gzip
    import hashlib
    import re

    readme = (CRDS / "README.md").read_text()
    listed = dict((name, digest) for digest, name in re.findall(r"^([0-9a-f]{64})  (\S+\.yaml)", readme, re.M))
    assert len(listed) == 4
    for path in sorted(CRDS.glob("*.yaml*")):
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        name = path.name.removesuffix(".gz")
        assert hashlib.sha256(data).hexdigest() == listed.pop(name), f"{path.name} is not the file the README names"
    assert not listed, f"README names files that are not there: {sorted(listed)}"
