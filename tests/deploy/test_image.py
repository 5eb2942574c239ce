"""The image the manifests run is the one the Dockerfile builds, on the Triton the tests run."""

from __future__ import annotations

import re

import yaml

from tests.deploy.conftest import CHART, KSERVE, ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the package's own fallback (tritonguard/core/config.py)
    import tomli as tomllib

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_base_release_is_an_arg_defaulting_to_the_tested_triton():
    arg = re.search(r"^ARG TRITON_RELEASE=(\S+)$", DOCKERFILE, re.M)
    assert arg, "the Dockerfile names its NGC release through ARG TRITON_RELEASE"
    # 24.10 is Triton 2.51, the server nvidia-pytriton 0.7.0 bundles and every test runs
    assert arg.group(1) == "24.10"
    assert "nvidia-pytriton==0.7.0" in (ROOT / "Makefile").read_text()
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    assert froms == ["nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"]
    assert DOCKERFILE.index("ARG TRITON_RELEASE=") < DOCKERFILE.index("FROM ")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["tritonguard/triton-release"] == arg.group(1)


def test_manifests_run_this_version_of_the_image():
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == "tritonguard" and values["image"]["tag"] == ""  # appVersion
    runtime = yaml.safe_load((KSERVE / "servingruntime.yaml").read_text())
    assert runtime["spec"]["containers"][0]["image"] == f"tritonguard:{version}"
    # the launcher the manifests start is the console script the image installs at that path
    assert "head -n1 /usr/local/bin/tritonserver | grep -q python" in DOCKERFILE
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tritonserver"] == "tritonguard.ops.launcher:tritonserver_main"
    # the example models the chart copies from the image are where the image exports them
    assert values["modelRepository"]["image"]["path"] == "/models"
    assert "--repository /models" in DOCKERFILE
