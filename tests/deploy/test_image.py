"""The image the manifests run is the one the Dockerfile builds: by default on a Triton release with
the 2025 Python-backend fixes, or on the Triton the tests run (24.10)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy.conftest import CHART, KSERVE, ROOT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the package's own fallback (tritonguard/core/config.py)
    import tomli as tomllib

DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _image_deps():
    """.ci/check_image_deps.py as a module: its PROFILES are the releases the image supports."""
    spec = importlib.util.spec_from_file_location("check_image_deps", ROOT / ".ci" / "check_image_deps.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def test_base_release_is_an_arg_defaulting_to_a_release_with_the_2025_fixes():
    deps = _image_deps()
    arg = re.search(r"^ARG TRITON_RELEASE=(\S+)$", DOCKERFILE, re.M)
    assert arg, "the Dockerfile names its NGC release through ARG TRITON_RELEASE"
    # 25.08 (Triton 2.60.0) has the fixes for CVE-2025-23319/-23320/-23334 (from 25.07); it is the
    # release check_image_deps resolves as the default
    assert arg.group(1) == deps.DEFAULT_RELEASE == "25.08"
    # 24.10 is Triton 2.51, the server nvidia-pytriton 0.7.0 bundles and every test runs: still buildable
    assert deps.PROFILES["24.10"].triton == "2.51.0"
    assert "nvidia-pytriton==0.7.0" in (ROOT / "Makefile").read_text()
    froms = re.findall(r"^FROM (\S+)", DOCKERFILE, re.M)
    assert froms == ["nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"]
    assert DOCKERFILE.index("ARG TRITON_RELEASE=") < DOCKERFILE.index("FROM ")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["annotations"]["tritonguard/triton-release"] == arg.group(1)


def test_the_build_picks_the_list_of_its_release():
    """The Dockerfile's release table is check_image_deps' profiles: the Python each list was
    resolved for and the CUDA major torch must be built for; anything else stops the build."""
    deps = _image_deps()
    rows = {release: (py, int(cuda)) for release, py, cuda in
            re.findall(r"^\s+(\d\d\.\d\d)\) py=(\S+) cuda=(\d+) ", DOCKERFILE, re.M)}
    assert rows == {r: (p.python, p.cuda[0]) for r, p in deps.PROFILES.items()}
    for profile in deps.PROFILES.values():
        assert profile.requirements.is_file(), profile.requirements
    assert "COPY docker/requirements-image-*.txt /tmp/image/" in DOCKERFILE
    assert 'req="/tmp/image/requirements-image-$TRITON_RELEASE.txt"' in DOCKERFILE
    assert re.search(r"^\s+\*\) echo .*>&2; exit 1 ;;", DOCKERFILE, re.M), "an unknown release stops the build"
    # the lists install as pinned, then hold together; the torch CUDA major is the release's
    assert 'python3 -m pip install --only-binary=:all: -r "$req"' in DOCKERFILE
    assert "python3 -m pip check" in DOCKERFILE
    assert "torch.version.cuda.split('.')[0] == '$cuda'" in DOCKERFILE


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


# .ci/check_image_deps.py's exit status when PyPI cannot be reached
EXIT_UNREACHABLE = 3


@pytest.mark.parametrize("release", sorted(_image_deps().PROFILES))
def test_image_requirements_resolve_for_their_python_and_cuda(release):
    """Online (PyPI, metadata only, 20-40 s a release): each release's pinned list resolves for its
    Python, manylinux target and CUDA (the offline half is tests/unit/test_image_deps.py)."""
    script = ROOT / ".ci" / "check_image_deps.py"
    out = subprocess.run([sys.executable, str(script), "--release", release], capture_output=True,
                         text=True, timeout=300, check=False)
    text = out.stdout + out.stderr
    if out.returncode == EXIT_UNREACHABLE:
        pytest.skip(f"PyPI unreachable, image dependency check not run: {text.strip()[-300:]}")
    assert out.returncode == 0, text
    print(out.stdout)
