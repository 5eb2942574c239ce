# tritonguard on the NGC Triton image.
# TRITON_RELEASE: the NGC release, one with a docker/requirements-image-<release>.txt:
#   25.08 (default): Triton 2.60.0, Ubuntu 24.04, Python 3.12, CUDA 13.0. It has the fixes for the
#         2025 Python-backend advisories (CVE-2025-23319/-23320/-23334, fixed in 25.07).
#   24.10: Triton 2.51 (the binary nvidia-pytriton 0.7.0 bundles), Ubuntu 22.04, Python 3.10, CUDA
#         12.6: the release every test here runs; inside the range of those advisories.
#   docker build --build-arg TRITON_RELEASE=24.10 …   builds the tested one.
# Not built in CI (no container engine on our machines); `make check-image` resolves both lists for
# their Python / manylinux target on every run instead (docs/docker.md says what was run).
ARG TRITON_RELEASE=25.08
FROM nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3
ARG TRITON_RELEASE
LABEL org.opencontainers.image.base.name="nvcr.io/nvidia/tritonserver:${TRITON_RELEASE}-py3"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_BREAK_SYSTEM_PACKAGES=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONPATH=/opt/tritonguard

WORKDIR /opt/tritonguard

# g++: exporter compile's torch_compile variant builds C++ with it (serving a model.pt2 does not)
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*

# Every Python package pinned, one list per release (the reason for each choice: that file), resolved
# for that release's Python and CUDA by .ci/check_image_deps.py (its PROFILES: the table below must
# match it). The image has its own Triton, so nvidia-pytriton's bundled server is not installed.
# - pip, setuptools and wheel of 25.08 are Debian's (python3-pip): pip cannot uninstall them, so the
#   pinned ones go beside them (--ignore-installed; /usr/local comes first on sys.path). 24.10's are
#   pip's own and are upgraded in place.
# - the image's virtualenv pins filelock<4: the lists upgrade it (tritonguard needs filelock 4.1).
# - 25.08's tritonfrontend wheel (the in-process API and the OpenAI frontend, unused here) pins
#   pydantic==2.10.6, tritonguard pydantic==2.14.4: it is removed, so `pip check` holds.
COPY docker/requirements-image-*.txt /tmp/image/
RUN case "$TRITON_RELEASE" in \
      25.08) py=3.12 cuda=13 own=--ignore-installed ;; \
      24.10) py=3.10 cuda=12 own= ;; \
      *) echo "TRITON_RELEASE=$TRITON_RELEASE has no docker/requirements-image-$TRITON_RELEASE.txt: use 25.08 or 24.10, or resolve a list for it first (docs/docker.md#a-newer-triton-release)" >&2; exit 1 ;; \
    esac \
 && req="/tmp/image/requirements-image-$TRITON_RELEASE.txt" \
 && python3 -c "import sys; v = '%d.%d' % sys.version_info[:2]; assert v == '$py', \
      'docker/requirements-image-$TRITON_RELEASE.txt is resolved for Python $py, this image has ' + v" \
 && python3 -m pip install $own pip==26.3 $(grep -E '^(setuptools|wheel)==' "$req") \
 && python3 -m pip uninstall -y tritonfrontend \
 && python3 -m pip install --only-binary=:all: -r "$req" \
 && python3 -m pip check \
 && python3 -c "import sys, torch, onnxruntime; sys.version_info >= (3, 11) or __import__('tomli'); \
      assert torch.version.cuda.split('.')[0] == '$cuda', torch.version.cuda; \
      print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'ort', onnxruntime.__version__, onnxruntime.get_available_providers())" \
 && rm -rf /tmp/image

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
# The default 25.08 has the fixes for CVE-2025-23319/-23320/-23334; 24.10 does not (docs/docker.md).
CMD ["/usr/local/bin/tritonserver", "--model-repository=/models", \
     "--model-control-mode=explicit", "--load-model=*", \
     "--http-header-forward-pattern=^(x-tenant-id|x-tritonguard-api-key|authorization|traceparent)$", \
     "--grpc-header-forward-pattern=^(x-tenant-id|x-tritonguard-api-key|authorization|traceparent)$"]
