#!/usr/bin/env bash
# The GPU suite: one command that, on a machine with an NVIDIA GPU, builds the extension with the
# CUDA kernels, runs the GPU tests (Triton and CUDA backends on CUDA tensors) and the GPU
# benchmarks, and writes everything under bench/results/<gpu>_<date>/ (and $OUT when set, for the
# device tool, which brings back at most 8 files).
#
#   bash bench/gpu_suite.sh              # full: build, tests, benchmarks
#   QUICK=1 bash bench/gpu_suite.sh      # tests + one small benchmark shape
#
# It uses the python3 that holds torch on that machine (no network there: nothing is installed).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'" || exit 2
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))")
STAMP=$(date -u +%Y-%m-%d)
RES=bench/results/${GPU}_${STAMP}
mkdir -p "$RES"
LOG="$RES/suite.log"
exec > >(tee -a "$LOG") 2>&1
echo "== $GPU $STAMP torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true

echo "== build (CUDA kernels, sm_90)"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export NAC_FAST_FORCE_CUDA=1
t0=$(date +%s)
$PY setup.py build_ext --inplace > "$RES/build.log" 2>&1 || { tail -40 "$RES/build.log"; echo BUILD FAILED; }
echo "build took $(( $(date +%s) - t0 )) s"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
$PY -c "import nac_fast; print('backends on cuda:', nac_fast.available_backends('cuda'))"

echo "== tests on the GPU"
# NAC_FAST_TEST_DEVICE=cuda makes the loss tests put their tensors on the GPU.
# test_hashing's "triton" backend runs on CUDA tensors here (compiled, not interpreted).
NAC_FAST_TEST_DEVICE=cuda $PY -m pytest -q -x tests/test_loss_backends.py tests/test_loss_reference.py \
  tests/test_hashing.py tests/test_noise.py -p no:cacheprovider --junitxml="$RES/pytest_gpu.xml" 2>&1 | tail -25

echo "== benchmarks"
if [ "${QUICK:-0}" = 1 ]; then
  $PY bench/bench_loss.py --device cuda --inbatch 4096 --queue 65536 --mq-n 8192 --dtypes bfloat16 \
      --compile-reference --csv "$RES/loss_gpu.csv"
else
  $PY bench/bench_loss.py --device cuda --inbatch 1024,4096,8192,16384 --queue 65536,262144 \
      --mq-n 512 --compile-reference --csv "$RES/loss_gpu.csv"
  $PY bench/bench_loss.py --device cuda --inbatch "" --queue 65536,262144 --mq-n 8192 \
      --compile-reference --csv "$RES/loss_gpu.csv"
fi
$PY bench/bench_hamming.py --gpu --no-rank --faiss-heap-queries 0 --torch-queries 0 \
    --csv "$RES/hamming_gpu.csv" 2>&1 | tail -12
$PY bench/plot_bench.py "$RES/loss_gpu.csv" --out "$RES" || true
if [ -n "${OUT:-}" ]; then cp "$RES"/*.csv "$RES"/*.png "$RES"/*.log "$RES"/*.xml "$OUT"/ 2>/dev/null; fi
echo "== results in $RES"
