"""Fixtures of tests/deploy: the tools' venv, the chart rendered once per values set.

The tools (Helm's template engine through helm-python-sdk, kubernetes-validate, checkov) live in
``.venv-deploy`` (``make deploy-venv``, a prerequisite of ``make test``): their pins clash with the
project's venv. Without that venv the tests skip and say how to build it, except under CI (``CI``
set), where a missing tool is a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tritonguard"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
KSERVE = ROOT / "deploy" / "kserve"
CRDS = Path(__file__).resolve().parent / "crds"
TOOL = Path(__file__).resolve().parent / "k8s_tool.py"
DEPLOY_VENV = ROOT / ".venv-deploy"
DEPLOY_PY = DEPLOY_VENV / "bin" / "python"
RELEASE, NAMESPACE = "tg", "serving"
# the chart's floor (Chart.yaml kubeVersion) and two newer releases
KUBE_VERSIONS = ("1.29", "1.31", "1.34")
# a GPU on top of the default values: what `--set gpu=true` renders
GPU_OVERLAY = "gpu: true\ngpuCount: 2\n"


def _tools_ready() -> None:
    if (DEPLOY_VENV / ".installed").exists() and DEPLOY_PY.exists():
        return
    why = f"{DEPLOY_VENV.name} is missing: `make deploy-venv` installs helm-python-sdk, kubernetes-validate and checkov"
    if os.environ.get("CI"):
        pytest.fail(why + " (CI runs `make test`, which builds it)")
    pytest.skip(why)


def run_tool(op: str, timeout: float = 120, **request) -> object:
    """One request to k8s_tool.py in the tools' venv; its JSON answer."""
    _tools_ready()
    proc = subprocess.run([str(DEPLOY_PY), str(TOOL)], input=json.dumps({"op": op, **request}),
                          capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"k8s_tool {op} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


def value_sets() -> dict[str, list[str]]:
    """Label -> values YAML documents: the chart's defaults, each example, defaults + GPU."""
    sets = {"default": []}
    for path in EXAMPLES:
        sets[f"examples/{path.name}"] = [path.read_text()]
    sets["default+gpu"] = [GPU_OVERLAY]
    return sets


def documents(manifests: dict[str, str]) -> list[tuple[str, dict]]:
    """(template, object) for every object the templates rendered, NOTES.txt aside."""
    out = []
    for template, text in sorted(manifests.items()):
        if template.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.append((template, doc))
    return out


def by_kind(docs: list[tuple[str, dict]], kind: str) -> list[dict]:
    return [d for _, d in docs if d["kind"] == kind]


def one(docs: list[tuple[str, dict]], kind: str, name: str | None = None) -> dict:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


@pytest.fixture(scope="session")
def rendered() -> dict[str, dict[str, str]]:
    """Label -> {template: manifest} for every values set, rendered by Helm's engine."""
    answer = run_tool("render", chart=str(CHART), name=RELEASE, namespace=NAMESPACE, sets=value_sets())
    failed = {label: r["error"] for label, r in answer.items() if not r["ok"]}
    assert not failed, f"the chart does not render: {failed}"
    return {label: r["manifests"] for label, r in answer.items()}


@pytest.fixture(scope="session")
def docs(rendered) -> dict[str, list[tuple[str, dict]]]:
    return {label: documents(manifests) for label, manifests in rendered.items()}
