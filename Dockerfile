# tritonguard on the NGC Triton image (Triton 2.51 = the binary nvidia-pytriton 0.7.0 bundles).
# The image: Ubuntu 22.04, Python 3.10 (/usr/bin/python3), CUDA 12.6.
# Not built in CI (no container engine on our machines); `make check-image` resolves its Python
# packages (docker/requirements-image.txt) for Python 3.10 / manylinux_2_35 on every run instead.
# TRITON_RELEASE: the NGC release. 24.10 (Triton 2.51) is the one every test runs; what a newer
# one changes, and what to re-resolve for it: docs/docker.md#a-newer-triton-release
ARG TRITON_RELEASE=24.10
FROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3
ARG TRITON_RELEASE
LABEL org.opencontainers.image.base.name="nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONPATH=/opt/tritonguard

WORKDIR /opt/tritonguard

# g++: exporter compile's torch_compile variant builds C++ with it (serving a model.pt2 does not)
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

# Every Python package pinned (the list and the reason for each choice: that file). The image has
# its own Triton, so nvidia-pytriton's bundled server is not installed. torch 2.7.1 from PyPI is
# the CUDA 12.6 build; for a newer torch built for CUDA 12.6 use
#   --extra-index-url https://download.pytorch.org/whl/cu126   (e.g. torch==2.10.0+cu126)
# and re-pin docker/requirements-image.txt (our check resolves PyPI only).
COPY docker/requirements-image.txt /tmp/requirements-image.txt
# the pins are resolved for Python 3.10: a release on another Python (24.12 and later: Ubuntu 24.04,
# Python 3.12) needs them re-resolved first (docs/docker.md#a-newer-triton-release)
RUN python3 -c 'import sys; v = sys.version_info[:2]; assert v == (3, 10), \
      f"docker/requirements-image.txt is resolved for Python 3.10, this image has {v[0]}.{v[1]}: re-resolve it (docs/docker.md)"' \
 && python3 -m pip install pip==26.3 \
 && python3 -m pip install --only-binary=:all: -r /tmp/requirements-image.txt \
 && python3 -m pip check \
 && python3 -c 'import tomli, torch, onnxruntime; assert torch.version.cuda.startswith("12."), torch.version.cuda; print("torch", torch.__version__, "CUDA", torch.version.cuda, "ort", onnxruntime.__version__, onnxruntime.get_available_providers())'

COPY pyproject.toml README.md ./
COPY tritonguard ./tritonguard
COPY exporter ./exporter
COPY examples ./examples
COPY backends ./backends

# Editable, so the launcher finds backends/ next to the package (tritonguard/launcher.py).
# --no-build-isolation: build with the pinned setuptools/wheel above, nothing unpinned fetched.
RUN python3 -m pip install --no-deps --no-build-isolation -e . \
 # Python-based backends: Triton looks for /opt/tritonserver/backends/<name>/model.py
 && for b in backends/*/; do ln -s "/opt/tritonguard/$b" "/opt/tritonserver/backends/$(basename "$b")"; done \
 # CMD runs the launcher, not Triton's binary: /opt/tritonserver/bin comes first on the image's
 # PATH, so a bare `tritonserver` would be the binary. Fail the build if pip put it elsewhere.
 && head -n1 /usr/local/bin/tritonserver | grep -q python \
 && python3 -c 'import tritonguard.core.config, tritonguard.ops.launcher as l; assert l.NGC_TRITONSERVER.exists()'

# Example models are generated, not shipped: the exporter builds them from packaged data.
RUN python3 -m exporter export --source examples.digits:build --name digits --repository /models \
 && python3 -m exporter export --source examples.minilm:build --name minilm --repository /models

EXPOSE 8000 8001 8002
# The launcher (the package's `tritonserver` console script) execs /opt/tritonserver/bin/tritonserver
# under tritonguard's supervisor (dead Python stubs reloaded, a crashed server restarted, SIGTERM
# forwarded) and, with no --model-control-mode given, adds --model-control-mode=explicit
# --load-model=*: explicit mode is what text-model promotion and the supervisor's reloads need.
# It is written out here too so `docker run IMAGE` shows it; pass your own flags to replace CMD.
# TRITONGUARD_SUPERVISE=0 makes the launcher exec Triton without the supervisor.
# Triton listens on 0.0.0.0 here, so the launcher restricts every API that changes the server
# (shared-memory, model-repository, model-config, trace, logging) under $TRITONGUARD_ADMIN_KEY, and
# refuses to start without it: `docker run -e TRITONGUARD_ADMIN_KEY=… IMAGE` (docs/docker.md).
# 24.10 is inside CVE-2025-23319/-23320/-23334 (fixed in 25.07): docs/docker.md says what is left.
CMD ["/usr/local/bin/tritonserver", "--model-repository=/models", \
     "--model-control-mode=explicit", "--load-model=*", \
     "--http-header-forward-pattern=^(x-tenant-id|x-tritonguard-api-key|authorization|traceparent)$", \
     "--grpc-header-forward-pattern=^(x-tenant-id|x-tritonguard-api-key|authorization|traceparent)$"]
