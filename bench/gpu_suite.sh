#!/usr/bin/env bash
# The GPU suite, in stages, for a lent H100/H200 reached one shell command at a time.
#
#   bash bench/gpu_suite.sh STAGE...   STAGE: build test autotune host bench-quick bench train
#                                             hamming hamming-tc train-jpeg | all
#   all = test autotune host train hamming (what matters most first).  NAC_FAST_SUITE_CPU=1: the
#   same stages at toy sizes on a machine without a GPU (CI, the plumbing).  Last lines, one per
#   stage: SUITE <stage> PASS|FAIL|SKIPPED <seconds>s <detail>; exit 0 only if every stage passed.
#   What each stage runs, time limits, results and environment: docs/gpu.md "The suite's stages".
#
# Every stage is sized for < 8 min on one H100 (NAC_FAST_STAGE_TIMEOUT, NAC_FAST_SUITE_DEADLINE).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
CPU_MODE=${NAC_FAST_SUITE_CPU:-0}
STAGES=(build test host autotune bench-quick bench train hamming hamming-tc train-jpeg)

usage() {
  sed -n '2,/^# Every stage/p' "$ROOT/bench/gpu_suite.sh" | sed '$d' | sed 's/^# \{0,1\}//' >&2
  echo "usage: bash bench/gpu_suite.sh STAGE...   (STAGE: ${STAGES[*]} all)" >&2
}

detail() { echo "$*" > "$RES/.detail_$STAGE"; }

# ---------------------------------------------------------------------------------------------
# stages (run in a child bash: bash gpu_suite.sh --run-stage NAME, with set -e)
# ---------------------------------------------------------------------------------------------

stage_build() {
  local log="$RES/build_ext.log"
  if [ "$CPU_MODE" = 1 ]; then
    export NAC_FAST_SKIP_EXT=1 TRITON_INTERPRET=1 NAC_FAST_TEST_DEVICE=cpu
    unset NAC_FAST_FORCE_CUDA
  else
    export NAC_FAST_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 NAC_FAST_TEST_DEVICE=cuda
    unset NAC_FAST_SKIP_CUDA NAC_FAST_SKIP_EXT
  fi
  echo "== build: NAC_FAST_FORCE_CUDA=${NAC_FAST_FORCE_CUDA:-} NAC_FAST_SKIP_EXT=${NAC_FAST_SKIP_EXT:-}" \
       "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-} MAX_JOBS=${MAX_JOBS:-} $PY setup.py build_ext --inplace"
  local t0=$SECONDS
  if ! $PY setup.py build_ext --inplace > "$log" 2>&1; then
    tail -n 60 "$log"
    detail "setup.py build_ext failed after $((SECONDS - t0))s (tail above; build_ext.log)"
    return 1
  fi
  local tb=$((SECONDS - t0))
  echo "build_ext took $tb s (log: build_ext.log)"
  # the source tree imports with its device's backends (JUnit pytest_build.xml)
  local rc=0
  run_tests build "" tests/test_install_modes.py::test_source_tree_has_its_devices_backends || rc=1
  detail "build_ext ${tb}s; import test: $(cat "$RES/.junit_build" 2>/dev/null || echo 'none')"
  return $rc
}

ensure_built() {
  if [ "$CPU_MODE" = 1 ]; then export TRITON_INTERPRET=1; return 0; fi
  $PY -c "import nac_fast, sys; sys.exit(not nac_fast.ops.dispatch.cuda_extension_built())" \
      2> /dev/null && return 0
  echo "== the CUDA extension is not built on this machine: running the build stage first"
  local t0=$SECONDS
  stage_build || { echo "build failed"; return 1; }
  BUILT_FIRST="built first in $((SECONDS - t0))s; "
}

run_summary() {  # (the commit: versions.json's, NAC_FAST_COMMIT)
  $PY bench/gpu_summary.py "$RES" --out "$RES/summary.json" --status-file "$RES/.goals"
}

bench_detail() {  # $1 = bench_loss rc
  local goals
  goals=$(cat "$RES/.goals" 2>/dev/null || echo "no summary")
  [ "$1" = 0 ] || goals="bench_loss FAILED (rows failed or crashed: see $STAGE.log); $goals"
  echo "$goals"
}

# pytest FILES with JUnit XML to $RES/pytest_NAME.xml (8 xdist workers for several FILES on a GPU
# machine: 16 cores share the GPU), then gpu_summary.py's verdict on it (REQUIRE: the backends that
# must have passed tests), written to $RES/.junit_NAME.  Exit status 0 only if both passed.
run_tests() {  # NAME REQUIRE FILES...
  local name=$1 require=$2 rc=0
  shift 2
  local xml="$RES/pytest_$name.xml" xdist=()
  if [ "$CPU_MODE" != 1 ] && [ $# -gt 1 ] && $PY -c "import xdist" 2>/dev/null; then
    xdist=(-n 8)
  fi
  rm -f "$xml"
  echo "== NAC_FAST_TEST_DEVICE=$NAC_FAST_TEST_DEVICE pytest $*"
  $PY -m pytest -q -rfEs -p no:cacheprovider "${xdist[@]}" --junitxml="$xml" "$@" || rc=$?
  echo "pytest exit status $rc"
  $PY bench/gpu_summary.py --check-junit "$xml" --require-passed "$require" \
      --status-file "$RES/.junit_$name" || rc=1
  return $rc
}

stage_test() {
  local rc=0
  if [ "$CPU_MODE" = 1 ]; then
    export NAC_FAST_TEST_DEVICE=cpu  # plumbing only: one quick file, no backend required
    run_tests gpu "" tests/test_noise.py || rc=1
  else
    # (the Hamming engine's tests run in the hamming stage)
    export NAC_FAST_TEST_DEVICE=cuda NAC_FAST_REQUIRE_EXT=1
    run_tests gpu triton,cuda tests/test_loss_numerics.py::TestBackends \
        tests/test_loss_numerics.py::TestReference tests/test_noise.py \
        tests/test_loss.py::TestInputs tests/test_loss_gpu.py tests/test_loss_host.py \
        tests/test_loss.py::TestDeviceGuard tests/test_queue.py \
        tests/test_loss_numerics.py::TestBf16x6 tests/test_loss_numerics.py::TestFp16x3 \
        tests/test_loss_numerics.py::TestFold tests/test_loss.py::TestContracts || rc=1
    # resources under the device's own Triton (docs/gpu.md "The suite's stages")
    local arch crc=0
    arch=$($PY -c "import torch; M, m = torch.cuda.get_device_capability(); print(10 * M + m)")
    if [ "$arch" = 90 ] || [ "$arch" = 80 ]; then
      # a problem on a 16-bit path fails the stage; fp32's (tf32x3: Triton 3.6 spills) reported
      rm -f "$RES/.compile_check"
      env -u TRITON_INTERPRET $PY tools/compile_check.py --archs "$arch" \
          --dtypes bfloat16,float16,float32 --D 128 --no-cuda --no-candidates --jobs 8 \
          --fail-on bfloat16,float16 --verdict-out "$RES/.compile_check" \
          --csv "$RES/compile_check_device.csv" > "$RES/compile_check_device.log" 2>&1 || crc=$?
      [ $crc = 0 ] || rc=1
      COMPILE_DETAIL="; $(cat "$RES/.compile_check" 2>/dev/null \
          || echo "compile check sm_$arch did not finish (exit $crc; compile_check_device.log)")"
    else
      COMPILE_DETAIL="; compile check: sm_$arch is not a checked arch (80, 90)"
    fi
  fi
  detail "${BUILT_FIRST}$(cat "$RES/.junit_gpu" 2>/dev/null || echo 'no JUnit verdict')${COMPILE_DETAIL:-}"
  return $rc
}

stage_bench_quick() {
  local rc=0 mode queue q=65536 modes="tf32x3 bf16x6 fp16x3"
  # issue 38's four shapes (its goals are the +graph rows at each), then its fp32 goal (>= 2x
  # eager): Triton in tf32x3, bf16x6 and (in-batch) fp16x3
  local bf16=(--device cuda --inbatch 8192,16384 --queue 65536,262144 --mq-n 8192 --reps 20
              --min-time 0.5) fp32=(--device cuda --inbatch 8192 --mq-n 8192 --reps 10 --min-time 0.25)
  if [ "$CPU_MODE" = 1 ]; then
    bf16=(--device cpu --inbatch 64 --queue 256 --mq-n 32 --compile-backend aot_eager --reps 3
          --min-time 0)
    fp32=(--device cpu --inbatch 64 --mq-n 32 --reps 2 --min-time 0) q=256 modes="bf16x6 fp16x3"
  fi
  $PY bench/bench_loss.py "${bf16[@]}" --dtypes bfloat16 --compile-reference \
      --csv "$RES/loss_gpu.csv" || rc=$?
  for mode in $modes; do
    queue=$q
    [ $mode = fp16x3 ] && queue=""
    NAC_FAST_FP32_DOT=$mode $PY bench/bench_loss.py "${fp32[@]}" --queue "$queue" \
        --dtypes float32 --backends triton --csv "$RES/loss_gpu.csv" || rc=$?
  done
  local brc=$rc
  run_summary || rc=1
  detail "${BUILT_FIRST}$(bench_detail $brc)"
  return $rc
}

stage_bench() {
  local rc=0 prc=0 extra=""
  # Sized to fit one stage's time limit on an H100 (the estimate: bench/results/notes.md).
  if [ "$CPU_MODE" = 1 ]; then
    $PY bench/bench_loss.py --device cpu --inbatch 64,128 --queue 256 --mq-n 32 --inbatch-self 64 \
        --dtypes bfloat16,float32 --compile-reference --compile-backend aot_eager --reps 2 \
        --min-time 0 --csv "$RES/loss_gpu.csv" || rc=$?
  else
    $PY bench/bench_loss.py --device cuda --inbatch 1024,4096,8192,16384 --queue 65536,262144 \
        --mq-n 8192 --inbatch-self 8192 --dtypes bfloat16,float32 --compile-reference --reps 10 --min-time 0.25 \
        --csv "$RES/loss_gpu.csv" || rc=$?
  fi
  local brc=$rc
  [ -f "$RES/loss_gpu.csv" ] && { $PY bench/plot_bench.py "$RES/loss_gpu.csv" --out "$RES" || prc=$?; }
  run_summary || rc=1
  [ $prc = 0 ] || { rc=1; extra="; plot_bench FAILED"; }
  detail "${BUILT_FIRST}$(bench_detail $brc)$extra"
  return $rc
}

stage_host() {
  local rc=0 args=(--gpu) d
  [ "$CPU_MODE" = 1 ] && args=(--calls 5 --repeats 1)
  # (under the stage's set -e a failing pipeline would end the stage before its detail)
  $PY bench/host_overhead.py "${args[@]}" --csv "$RES/host_gpu.csv" | tee "$RES/host.log" \
      || rc=${PIPESTATUS[0]}
  d=$(sed -n 's/^fused host: //p' "$RES/host.log" | tail -1)
  [ $rc = 0 ] || d="host_overhead exit status $rc; ${d:-no host_gpu.csv}"
  detail "${BUILT_FIRST}${d:-no fused rows}"
  return $rc
}

stage_hamming() {
  local rc=0 trc=0 junit="no tests run"
  if [ "$CPU_MODE" != 1 ]; then
    # the engine's tests on CUDA tensors first, then its figures beside the C++ engine's
    export NAC_FAST_TEST_DEVICE=cuda NAC_FAST_REQUIRE_EXT=1
    run_tests hamming triton,cuda tests/test_hashing.py tests/test_hamming_gpu.py \
        tests/test_hamming_cuda.py tests/test_retrieval_metrics.py tests/test_index.py \
        tests/test_gpu_user_paths.py \
        tests/test_index_cli.py::test_search_on_the_gpu_gives_the_cpus_answer \
        tests/test_hamming_gpu.py::test_max_rows_gallery_on_a_gpu \
        tests/test_redzone.py::test_hamming_kernels_stay_in_bounds || trc=1
    junit=$(cat "$RES/.junit_hamming" 2>/dev/null || echo "no JUnit verdict")
  fi
  $PY bench/bench_hamming.py --gpu "${TOY[@]}" --csv "$RES/hamming_gpu.csv" || rc=$?
  local d="bench_hamming exit status $rc"
  [ $rc = 0 ] && d="bench_hamming --gpu ok (hamming_gpu.csv)"
  detail "${BUILT_FIRST}tests: $junit; $d"
  [ $trc = 0 ] || rc=1
  return $rc
}

# bench_hamming.py --gpu at issue 56's sizes (no C++ rows), then Nsight Compute on the tensor-core
# filter (a missing or refused ncu: said, not failed); the verdict is the bench's (docs/gpu.md)
stage_hamming_tc() {
  local rc=0 nrc=0 ncu="" note="ncu: not run in CPU mode"
  rm -f "$RES/.summary_hamming_tc"
  $PY bench/bench_hamming.py --gpu "${TOY[@]}" --map-sizes 1000000 --cpu-map-queries 0 \
      --cpu-topk-queries 0,0 --check-queries 64 --budget-s 1000 --csv "$RES/hamming_tc.csv" \
      --summary-out "$RES/.summary_hamming_tc" || rc=$?
  if [ "$CPU_MODE" != 1 ]; then
    ncu=$(command -v ncu || { [ -x /usr/local/cuda/bin/ncu ] && echo /usr/local/cuda/bin/ncu; } || true)
    if [ -z "$ncu" ]; then
      note="ncu: not found"
      echo "$note" > "$RES/hamming_tc_ncu.txt"
    else
      # sections every ncu knows (each launch's time; the tensor-pipe counters: docs/gpu.md)
      timeout 150 "$ncu" --target-processes all --kernel-name regex:_topk_mma_kernel \
          --launch-count 8 --section SpeedOfLight --section ComputeWorkloadAnalysis \
          $PY bench/bench_hamming.py --gpu --profile-run > "$RES/hamming_tc_ncu.txt" 2>&1 || nrc=$?
      note="ncu: profile in hamming_tc_ncu.txt"
      [ $nrc = 0 ] || note="ncu exit status $nrc: see hamming_tc_ncu.txt"
    fi
  fi
  local d
  d=$(cat "$RES/.summary_hamming_tc" 2>/dev/null || echo "no hamming_tc.csv")
  [ $rc = 0 ] || d="bench_hamming --gpu exit status $rc; $d"
  detail "${BUILT_FIRST}$d; $note"
  return $rc
}

stage_autotune() {
  local rc=0
  if [ "$CPU_MODE" = 1 ]; then
    $PY tools/autotune.py --cpu --out-dir "$RES" --overwrite --rows-sweep || rc=$?
  else
    # installed in kernels/tuned/ for the later stages; back in $RES (sm90.json) for review
    $PY tools/autotune.py --out-dir "$RES" --install --overwrite \
        --budget-s "${NAC_FAST_AUTOTUNE_BUDGET_S:-120}" \
        --rows-sweep --rows-budget-s "${NAC_FAST_ROWS_BUDGET_S:-30}" || rc=$?
  fi
  local d="autotune exit status $rc"
  [ $rc = 0 ] && d="autotune ok (autotune.csv, table in $(basename "$RES"))"
  detail "${BUILT_FIRST}$d"
  return $rc
}

json_summary() {  # FILE: the 'summary' of train_throughput.py's JSON
  $PY -c 'import json, sys; print(json.load(open(sys.argv[1]))["summary"])' "$1" 2>/dev/null \
      || echo "no $(basename "$1")"
}

stage_train() {
  local rc=0
  rm -f "$RES/train.json" "$RES/train_kernels_top15.txt"  # train_throughput does not replace
  # train.py's defaults, then the eager rate while NAC_FAST_TRAIN_BUDGET_S lasts
  local size=(--data synthetic-device:1281167 --arch resnet50 --batch-size 256 --image-size 224
              --amp bf16 --channels-last --queue-size 65536 --warmup 10 --steps 30
              --budget-s "${NAC_FAST_TRAIN_BUDGET_S:-150}")
  [ "$CPU_MODE" = 1 ] && size=(--data synthetic-device:256 --arch resnet-tiny --batch-size 32
                               --image-size 16 --amp off --queue-size 128 --warmup 1 --steps 2
                               --compile --compile-backend aot_eager --budget-s 150)
  $PY bench/train_throughput.py --method nac-mq "${size[@]}" --sync-check \
      --profile-out "$RES/train_kernels_top15.txt" --json-out "$RES/train.json" \
      --csv-out "$RES/train_throughput.csv" || rc=$?
  local trc=$rc
  run_summary || rc=1
  local d
  d=$(json_summary "$RES/train.json")
  [ $trc = 0 ] || d="train_throughput exit status $trc; $d"
  detail "${BUILT_FIRST}$d"
  return $rc
}

# train-jpeg (issue 54): train_throughput.py on a JPEG tree on the machine's local disk, ResNet-50
# NAC-MQ with --loader dali-gpu, beside the synthetic-data figure of the train stage.  DALI is not
# in the device image: carry it first (tools/carry_wheel.sh, docs/gpu.md).
JPEG_SYNTHETIC_IMG_S=2181   # train stage, synthetic images (NVIDIA-H100-80GB-HBM3_2026-11-27_run2)
stage_train_jpeg() {
  local tree=${NAC_FAST_JPEG_TREE:-/tmp/nac_fast_jpeg_tree}
  local steps=${NAC_FAST_JPEG_STEPS:-240} warm=${NAC_FAST_JPEG_WARMUP:-60}
  local classes=100 size=500 batch=256 quirks="grey=0.01,cmyk=0.001,png=0.001,exif=0.001"
  local train_args=(--loader dali-gpu --arch resnet50 --image-size 224 --amp bf16
                    --channels-last --queue-size 65536 --workers 0 --no-eager-baseline)
  local qloader=dali-gpu qdevice=cuda
  if [ "$CPU_MODE" = 1 ]; then   # the plumbing only: a tiny tree and model, dali-cpu
    tree=${NAC_FAST_JPEG_TREE:-/tmp/nac_fast_jpeg_tree_cpu}
    steps=${NAC_FAST_JPEG_STEPS:-6} warm=${NAC_FAST_JPEG_WARMUP:-2} classes=4 size=64 batch=8
    train_args=(--loader dali-cpu --arch resnet-tiny --image-size 32 --amp off --queue-size 64
                --no-compile --workers 2)
    qloader=dali-cpu qdevice=cpu
  fi
  # the timed windows are train_throughput's: --warmup steps each, the first one not timed
  [[ "$steps" =~ ^[0-9]+$ && "$warm" =~ ^[1-9][0-9]*$ && $warm -lt $steps && $((steps % warm)) = 0 ]] || {
    detail "NAC_FAST_JPEG_STEPS ($steps) must be a multiple of NAC_FAST_JPEG_WARMUP ($warm), above it"; return 2; }
  $PY -c "import nvidia.dali" 2>/dev/null || {
    detail "NVIDIA DALI is not importable ($PY): carry it first (tools/carry_wheel.sh, docs/gpu.md)"; return 1; }
  # one epoch covers the run (no epoch boundary, whose pipeline rebuild would enter the figure)
  local per_class=$(( ((steps + 10) * batch + classes - 1) / classes ))
  # 1. the tree: made once per machine (kept on a warm one: --reuse), remade when its arguments
  # differ; a folder that is not such a tree is refused
  local t0=$SECONDS made mrc=0
  made=$($PY scripts/make_ilsvrc_tree.py --out "$tree" --reuse --overwrite --classes "$classes" \
         --train-per-class "$per_class" --val-per-class 1 --size "$size" --quirks "$quirks" \
         --workers "$(nproc)") || mrc=$?
  echo "$made"
  [ $mrc = 0 ] || {
    detail "make_ilsvrc_tree.py exit status $mrc, NAC_FAST_JPEG_TREE=$tree (its error above)"; return 2; }
  [[ "$made" = *": reused, "* ]] && made=reused || made="made in $((SECONDS - t0)) s"
  cp "$tree/make_ilsvrc_tree.json" "$RES/train_jpeg_tree.json"
  # 2. the bad-file and quirk behaviour of this loader against the torchvision loader: the CPU
  # tests' check, here on the GPU decoder (JUnit pytest_train_jpeg.xml)
  local qrc=0 quirk=PASS
  export NAC_FAST_TEST_DEVICE=$qdevice
  run_tests train_jpeg "" "tests/test_data_dali.py::test_dali_matches_torchvision_on_every_quirk[$qloader]" \
      || { qrc=1; quirk=FAIL; }
  # 3. the timed run: train.py's own step (its defaults: compiled on a GPU) by train_throughput.py
  local rc=0
  rm -f "$RES/train_jpeg.json"
  $PY bench/train_throughput.py --data "$tree" --method nac-mq "${train_args[@]}" \
      --batch-size "$batch" --warmup "$warm" --steps $((steps - warm)) \
      --json-out "$RES/train_jpeg.json" --csv-out "$RES/train_jpeg.csv" || rc=$?
  local d ips
  d=$(json_summary "$RES/train_jpeg.json")
  ips=${d%% img/s*}
  if [[ "$ips" =~ ^[0-9]+$ ]]; then
    d="$d, $(awk -v a="$ips" -v b=$JPEG_SYNTHETIC_IMG_S 'BEGIN { printf "%.3f", a / b }') of"
    d="$d synthetic $JPEG_SYNTHETIC_IMG_S"
  fi
  [ $rc = 0 ] || d="train_throughput exit status $rc; $d"
  d="$d; tree $((classes * per_class)) files ($made); quirk check $quirk"
  detail "${BUILT_FIRST}$d"
  [ $rc = 0 ] && [ $qrc = 0 ]
}

if [ "${1:-}" = "--run-stage" ]; then  # internal: one stage, in this child process
  STAGE=$2
  set -e
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  BUILT_FIRST=""  # every stage but build builds first when no loadable extension is there
  TOY=()  # the bench scripts' toy sizes on the CPU (the Triton engine under the interpreter)
  [ "$CPU_MODE" = 1 ] && TOY=(--device cpu --tiny)
  [ "$STAGE" = build ] || ensure_built || { detail "build failed"; exit 1; }
  "stage_${STAGE//-/_}"
  exit $?
fi

# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

[ $# -ge 1 ] || { usage; exit 2; }
REQ=()
for a in "$@"; do
  case "$a" in
    all) REQ+=(test autotune host train hamming) ;;
    build|test|host|autotune|bench-quick|bench|train|hamming|hamming-tc|train-jpeg) REQ+=("$a") ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_suite.sh: unknown stage '$a'" >&2; usage; exit 2 ;;
  esac
done

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NAC_FAST_SUITE_CPU="$CPU_MODE"
if [ -z "${NAC_FAST_COMMIT:-}" ]; then
  NAC_FAST_COMMIT=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || true)
  [ -n "$NAC_FAST_COMMIT" ] && export NAC_FAST_COMMIT
fi
if [ "$CPU_MODE" = 1 ]; then export TRITON_INTERPRET=1; fi

# ---- preflight: the device's name (the results folder's), the versions (versions.json, the
# summary's first line): tools/suite_preflight.py
if ! PRE=$($PY tools/suite_preflight.py); then
  echo "SUITE preflight FAIL no usable python/torch/GPU ($PY)"
  exit 2
fi
{ read -r NAME; read -r VERSIONS_LINE; VERSIONS_JSON=$(cat); } <<< "$PRE"
TAG=${NAC_FAST_SUITE_TAG:-}
if [ -n "$TAG" ] && ! [[ "$TAG" =~ ^[A-Za-z0-9._-]+$ ]]; then
  echo "NAC_FAST_SUITE_TAG must be letters, digits, '.', '_' or '-', got '$TAG'" >&2
  exit 2
fi
RES=${NAC_FAST_SUITE_RESULTS:-$ROOT/bench/results/${NAME}_$(date -u +%Y-%m-%d)${TAG:+_$TAG}}
mkdir -p "$RES" || exit 2
RES=$(cd "$RES" && pwd)
export RES PY CPU_MODE
echo "$VERSIONS_JSON" > "$RES/versions.json"
echo "== results: $RES"

package_out() {
  [ -n "${OUT:-}" ] || return 0
  mkdir -p "$OUT"
  local parent base
  parent=$(dirname "$RES"); base=$(basename "$RES")
  tar -czf "$OUT/suite_results.tar.gz" -C "$parent" "$base" 2>/dev/null
  if [ "$(stat -c %s "$OUT/suite_results.tar.gz" 2>/dev/null || echo 0)" -gt 15728640 ]; then
    echo "suite_results.tar.gz over 15 MiB: packing it again without PNGs and build_ext.log"
    tar -czf "$OUT/suite_results.tar.gz" -C "$parent" --exclude='*.png' --exclude=build_ext.log "$base"
  fi
  local f
  for f in suite_summary.txt host_gpu.csv loss_gpu.csv hamming_gpu.csv train.json \
           train_kernels_top15.txt train_jpeg.csv; do
    [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/$f"
  done
  local n
  n=$(find "$OUT" -maxdepth 3 -type f | wc -l)
  [ "$n" -le 8 ] || echo "WARNING: $n files under \$OUT (the device tool brings back 8)"
}

SUMMARY=("$VERSIONS_LINE")
echo "$VERSIONS_LINE" > "$RES/suite_summary.txt"
STAGE_TIMEOUT=${NAC_FAST_STAGE_TIMEOUT:-540}
# NAC_FAST_STAGE_LIMITS="test=90,host=120": a stage's own limit in seconds (else STAGE_TIMEOUT),
# so that one slow stage cannot eat the time of those after it
stage_limit() {
  local item lims=${NAC_FAST_STAGE_LIMITS:-}
  for item in ${lims//,/ }; do
    if [ "${item%%=*}" = "$1" ] && [[ "${item#*=}" =~ ^[0-9]+$ ]]; then echo "${item#*=}"; return; fi
  done
  echo "$STAGE_TIMEOUT"
}
if [ -n "${OUT:-}" ]; then DEADLINE=${NAC_FAST_SUITE_DEADLINE:-560}; else DEADLINE=${NAC_FAST_SUITE_DEADLINE:-0}; fi
START=0  # the deadline counts from the command's start (bash's SECONDS)
fail=0 build_failed=0
for stage in "${REQ[@]}"; do
  left=$((DEADLINE - (SECONDS - START)))
  if [ "$build_failed" = 1 ]; then
    line="SUITE $stage SKIPPED 0s build failed"
    fail=1
  elif [ "$DEADLINE" -gt 0 ] && [ "$left" -lt 30 ]; then
    line="SUITE $stage SKIPPED 0s suite deadline (${DEADLINE}s) reached"
    fail=1
  else
    limit=$(stage_limit "$stage")
    if [ "$DEADLINE" -gt 0 ] && [ "$left" -lt "$limit" ]; then limit=$left; fi
    rm -f "$RES/.detail_$stage"
    echo "== stage $stage (limit ${limit}s)"
    t0=$SECONDS
    limiter=()
    command -v timeout > /dev/null && limiter=(timeout -k 15 "$limit")
    "${limiter[@]}" bash "$ROOT/bench/gpu_suite.sh" --run-stage "$stage" 2>&1 | tee "$RES/$stage.log"
    rc=${PIPESTATUS[0]}
    dt=$((SECONDS - t0))
    d=$(cat "$RES/.detail_$stage" 2>/dev/null || true)
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then d="timed out after ${limit}s${d:+; $d}"; fi
    if [ "$rc" = 0 ]; then verdict=PASS; else verdict=FAIL; fail=1; fi
    [ "$rc" = 0 ] || d="${d:-exit status $rc}"
    line="SUITE $stage $verdict ${dt}s $d"
    if [ "$stage" = build ] && [ "$rc" != 0 ]; then build_failed=1; fi
  fi
  SUMMARY+=("$line")
  echo "$line" >> "$RES/suite_summary.txt"
  package_out
done

echo
echo "== results in $RES${OUT:+ (and \$OUT)}"
for line in "${SUMMARY[@]}"; do echo "$line"; done
exit $fail
