#!/usr/bin/env bash
# The CUDA path, measured, in one command on one GPU (under 8 minutes wall in all):
#
#   bash benchmarks/gpu_check.sh [--dry]
#
# 0. installs the carried wheels (.whl/*.whl, see benchmarks/fetch_gpu_wheels.sh) into
#    /tmp/site, records nvidia-smi, torch / CUDA versions and the GPU name;
# 1. the CUDA tests (pytest -m cuda: tests/test_cuda.py);
# 2. three 3-epoch synthetic DeepLabV3 CALS-ALM runs: train.amp fp16, bf16, and bf16 with
#    train.channels_last + train.compile; checks history.jsonl (3 epochs, every lambda finite)
#    and test_metrics.json (pre_ts.ece finite);
# 3. bench_loss (8x21x512x512), bench_metrics (against torchmetrics), bench_eval (meters and
#    calibrators at Cityscapes / ADE20K shapes, as ratios to softmax), each also in copies of
#    the logits (logits.clone() timed in the same run: the memory limit), bench_train_step
#    (DeepLabV3-ResNet50, 512x512, batch 8, amp auto -> bf16 and fp16), then the torch.compile
#    work last: the sync-free and compiled-criterion CUDA tests (tests/test_cuda_compile.py:
#    torch.cuda.set_sync_debug_mode("error") around training steps, eager and compiled), the
#    compile run of 2., bench_loss --compile (F.cross_entropy, ce, cals_alm) and
#    bench_train_step --compile (what most likely runs long, last);
# and writes ONE markdown report, $OUT/gpu_check.md ($OUT unset: runs/gpu_check/gpu_check.md),
# with the targets and the measured values, plus the raw output of every stage in
# gpu_check.log beside it.
#
# GPU_CHECK_SKIP="stage names ..." skips those stages (e.g. a rerun of the benchmarks only:
# GPU_CHECK_SKIP="run_fp16 run_bf16 run_bf16_channels_last_compile bench_metrics"; the compile
# and sync checks only: GPU_CHECK_SKIP="cuda_tests run_fp16 run_bf16 bench_loss bench_metrics
# bench_train_step_auto bench_train_step_fp16 run_bf16_channels_last_compile").
#
# Every stage runs under `timeout`, limited both by its own budget and by what is left of the
# global deadline (GPU_CHECK_DEADLINE seconds, default 560, about 9 min), and a failed or timed-out
# stage is recorded and the next one runs.
#
# --dry (automatic when torch sees no CUDA device): CUDA tests skip, 2 runs of 1 epoch on the
# CPU with train.amp=auto on a tiny dataset (the second with channels_last, without compile),
# benchmarks at tiny sizes with 1 step; about a minute on 2 CPU cores. PYTHON selects the
# interpreter (default: python3).
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DRY=0
for arg in "$@"; do
  case $arg in
    --dry) DRY=1 ;;
    *) echo "usage: bash benchmarks/gpu_check.sh [--dry]" >&2; exit 2 ;;
  esac
done
START=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE:-560}
DEST=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$DEST"
MD=$DEST/gpu_check.md
LOG=$DEST/gpu_check.log
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
: >"$LOG"
: >"$WORK/stages.md"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

elapsed() { echo $(($(date +%s) - START)); }

# stage NAME BUDGET_S CMD...: run CMD under timeout (its budget, capped by the deadline), output
# to $WORK/NAME.out and the log; sets STATUS (ok / FAILED rc=N / TIMEOUT after Ns / SKIPPED) and
# SECONDS_TAKEN, and adds a row to the stage table.
stage() {
  local name=$1 budget=$2
  shift 2
  local left=$((DEADLINE - $(elapsed) - 10))
  local limit=$((budget < left ? budget : left))
  local t0 rc
  t0=$(date +%s)
  echo "===== $name (limit ${limit}s, at $(elapsed)s): $*" >>"$LOG"
  if [ "$limit" -lt 5 ]; then
    STATUS="SKIPPED (time budget spent)"
    : >"$WORK/$name.out"
  elif [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    STATUS="SKIPPED (GPU_CHECK_SKIP)"
    : >"$WORK/$name.out"
  else
    timeout -k 10 "$limit" "$@" >"$WORK/$name.out" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then
      STATUS=ok
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      STATUS="TIMEOUT after ${limit}s"
    else
      STATUS="FAILED rc=$rc"
    fi
  fi
  SECONDS_TAKEN=$(($(date +%s) - t0))
  cat "$WORK/$name.out" >>"$LOG"
  echo "===== $name: $STATUS in ${SECONDS_TAKEN}s" >>"$LOG"
  echo "| $name | $STATUS | $SECONDS_TAKEN | $limit |" >>"$WORK/stages.md"
}

fence() {  # fence FILE [LINES]: the file (its last LINES lines) as a code block
  echo '```'
  if [ -n "${2:-}" ]; then tail -n "$2" "$1"; else cat "$1"; fi
  echo '```'
}

# ---------------------------------------------------------------- 0. environment and wheels
WHEELS="none carried"
if [ "$DRY" -eq 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  stage wheels 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
  WHEELS="$(ls .whl/*.whl | wc -l) wheels from .whl: $STATUS"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
elif [ "$DRY" -eq 1 ]; then
  WHEELS="not installed (--dry)"
fi
stage environment 60 "$PY" -c '
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "cudnn", torch.backends.cudnn.version())
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu:", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs",
          "bf16:", torch.cuda.is_bf16_supported())
for m in ("segmentation_models_pytorch", "albumentations", "timm", "torchmetrics", "cv2"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "NOT IMPORTABLE:", type(e).__name__, e)
'
ENV_STATUS=$STATUS
CUDA=$(grep -c '^cuda available: True' "$WORK/environment.out")
if [ "$CUDA" -eq 0 ] && [ "$DRY" -eq 0 ]; then
  DRY=1
  AUTO_DRY=" (automatic: torch sees no CUDA device)"
fi
if [ "$DRY" -eq 1 ]; then
  # one thread: tiny CPU work is faster without OpenMP spin-waits on a shared machine
  export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 30 nvidia-smi >"$WORK/nvidia-smi.out" 2>&1 || echo "(nvidia-smi failed)" >>"$WORK/nvidia-smi.out"
else
  echo "nvidia-smi: not found" >"$WORK/nvidia-smi.out"
fi
cat "$WORK/nvidia-smi.out" >>"$LOG"

# ---------------------------------------------------------------------------- 1. CUDA tests
stage cuda_tests 90 "$PY" -m pytest -q -m cuda tests -p no:cacheprovider -W ignore::UserWarning \
  --ignore=tests/test_cuda_compile.py
TESTS_STATUS=$STATUS

# ------------------------------------------------------------------------ 2. training runs
CONFIG=configs/synthetic_deeplabv3_cals_alm.yaml
DATA=$WORK/data
if [ "$DRY" -eq 1 ]; then
  EPOCHS=1
  stage synthetic_data 60 "$PY" tools/make_synthetic.py --root "$DATA" --num-train 8 \
    --num-test 2 --image-size 32
  COMMON=("data.synthetic={num_train: 8, num_test: 2, image_size: 32}" data.crop_size=32
    train.threads=1 train.batch_size=4 eval.batch_size=4 eval.num_maps=1
    "model.params={encoder_output_stride: 16, decoder_channels: 32}")
  RUNS=("amp_auto|train.amp=auto" "channels_last|train.amp=auto train.channels_last=true")
else
  EPOCHS=3
  stage synthetic_data 60 "$PY" tools/make_synthetic.py --root "$DATA"
  COMMON=()
  RUNS=("fp16|train.amp=fp16" "bf16|train.amp=bf16")
  # after the eager benchmarks: compilation is what most likely runs long
  LATE_RUNS=("bf16_channels_last_compile|train.amp=bf16 train.channels_last=true train.compile=true")
fi
RUN_ROWS=$WORK/runs.md
"$PY" benchmarks/gpu_check_report.py run-header >"$RUN_ROWS"
train_run() {  # train_run "LABEL|KEY=VALUE ...": one run, its row in the run table
  local spec=$1 label=${1%%|*} budget=75
  local -a extra
  read -r -a extra <<<"${spec#*|}"
  case $label in *compile*) budget=130 ;; esac
  stage "run_$label" $budget "$PY" tools/train_seg.py "$CONFIG" --set train.epochs=$EPOCHS \
    train.progress=false "output_dir=$WORK/runs" "name=$label" "data.root=$DATA" \
    ${COMMON[@]+"${COMMON[@]}"} "${extra[@]}"
  "$PY" benchmarks/gpu_check_report.py run "$WORK/runs/$label" "$label (${spec#*|})" \
    $EPOCHS "$STATUS" "$SECONDS_TAKEN" >>"$RUN_ROWS" 2>>"$LOG" \
    || echo "| $label | $STATUS | report failed | | | | $SECONDS_TAKEN | FAIL |" >>"$RUN_ROWS"
}
for spec in "${RUNS[@]}"; do
  train_run "$spec"
done

# ---------------------------------------------------------------------------- 3. benchmarks
if [ "$DRY" -eq 1 ]; then
  DEV=cpu
  LOSS_ARGS=(--shape 2 5 32 32 --repeats 1 --losses F.cross_entropy ce cals_alm)
  COMPILE_ARGS=(--shape 2 5 32 32 --repeats 1 --losses F.cross_entropy cals_alm --compile eager)
  METRIC_ARGS=(--pixels 2e4 --batch 2 5 32 32 --repeats 1 --no-pinned)
  EVAL_ARGS=(--quick --no-loop)
  STEP_ARGS=(--size 32 --batch 2 --encoder resnet18 --steps 1)
  STEP_COMPILE_ARGS=(--size 32 --batch 2 --encoder resnet18 --steps 1 --compile eager)
  STEP_AMPS=(auto)
else
  DEV=cuda
  LOSS_ARGS=(--shape 8 21 512 512 --repeats 10)
  COMPILE_ARGS=(--shape 8 21 512 512 --repeats 10 --losses F.cross_entropy ce cals_alm --compile)
  METRIC_ARGS=(--pixels 1e8 --batch 8 21 512 512 --repeats 2)
  EVAL_ARGS=(--repeats 3)
  STEP_ARGS=(--size 512 --batch 8 --encoder resnet50 --steps 15)
  STEP_COMPILE_ARGS=(--size 512 --batch 8 --encoder resnet50 --steps 10 --compile)
  STEP_AMPS=(auto fp16)
fi
stage bench_loss 60 "$PY" benchmarks/bench_loss.py --device $DEV "${LOSS_ARGS[@]}"
BENCH_OUTS=("$WORK/bench_loss.out")
stage bench_metrics 90 "$PY" benchmarks/bench_metrics.py --device $DEV "${METRIC_ARGS[@]}"
BENCH_OUTS+=("$WORK/bench_metrics.out")
stage bench_eval 90 "$PY" benchmarks/bench_eval.py --device $DEV "${EVAL_ARGS[@]}"
BENCH_OUTS+=("$WORK/bench_eval.out")
for amp in "${STEP_AMPS[@]}"; do
  stage "bench_train_step_$amp" 60 "$PY" benchmarks/bench_train_step.py --device $DEV \
    --amp "$amp" "${STEP_ARGS[@]}"
  BENCH_OUTS+=("$WORK/bench_train_step_$amp.out")
done
stage cuda_compile_tests 120 "$PY" -m pytest -q -m cuda tests/test_cuda_compile.py \
  -p no:cacheprovider -W ignore::UserWarning
COMPILE_TESTS_STATUS=$STATUS
for spec in ${LATE_RUNS[@]+"${LATE_RUNS[@]}"}; do
  train_run "$spec"
done
stage bench_loss_compiled 150 "$PY" benchmarks/bench_loss.py --device $DEV "${COMPILE_ARGS[@]}"
BENCH_OUTS+=("$WORK/bench_loss_compiled.out")
stage bench_train_step_compiled 200 "$PY" benchmarks/bench_train_step.py --device $DEV \
  --amp auto "${STEP_COMPILE_ARGS[@]}"
BENCH_OUTS+=("$WORK/bench_train_step_compiled.out")

# -------------------------------------------------------------------------------- report
{
  echo "# GPU check"
  echo
  echo "- mode: $([ "$DRY" -eq 1 ] && echo "dry${AUTO_DRY:-} (CPU, tiny sizes)" || echo full)"
  echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- wheels: $WHEELS"
  echo "- total wall: $(elapsed) s (deadline ${DEADLINE} s)"
  echo
  echo "## 0. Environment"
  echo
  echo "environment stage: $ENV_STATUS"
  fence "$WORK/environment.out"
  fence "$WORK/nvidia-smi.out"
  echo
  echo "## 1. CUDA tests"
  echo
  echo "pytest -m cuda: $TESTS_STATUS"
  fence "$WORK/cuda_tests.out" 40
  echo
  echo "tests/test_cuda_compile.py (sync-free training steps, compiled criteria): $COMPILE_TESTS_STATUS"
  fence "$WORK/cuda_compile_tests.out" 30
  echo
  echo "## 2. Training runs"
  echo
  echo "Synthetic DeepLabV3 CALS-ALM, $EPOCHS epoch(s) each; PASS = the stage exited 0, all"
  echo "epochs are in history.jsonl, every lambda is finite and test_metrics pre_ts.ece is finite."
  echo
  cat "$RUN_ROWS"
  echo
  echo "## 3. Benchmarks"
  echo
  for f in "${BENCH_OUTS[@]}"; do
    echo "### $(basename "$f" .out)"
    echo
    # the TARGET lines go to section 4; torch's multi-line log records (W1126 ...) to the log only
    grep -v -E '^(TARGET \||[WIE][0-9]{4} )' "$f" | tail -n 80
    echo
  done
  echo "## 4. Targets"
  echo
  echo "Every benchmark above also gives its costs in copies of the logits (logits.clone(), timed in"
  echo "the same run: how far each is from the memory limit) and names the device."
  echo
  echo "Targets: CALS-ALM forward+backward at most 1.5x F.cross_entropy (eager, and compiled);"
  echo "a DeepLabV3 training step with CALS-ALM at most 1.02x CE's (eager, and compiled); CalibrationMeter +"
  echo "SegmentationMeter at least 5x torchmetrics' throughput at the same pixel count; the loss's"
  echo "peak memory at most CE's plus one logits-sized tensor; at Cityscapes / ADE20K shapes, the"
  echo "CalibrationMeter update at most 2x softmax, boundary_ts 1.5x, lts 5x, each meter's peak"
  echo "extra memory at most 2 logits tensors."
  echo
  "$PY" benchmarks/gpu_check_report.py targets "${BENCH_OUTS[@]}"
  echo
  echo "## 5. Stages"
  echo
  echo "| stage | status | seconds | limit (s) |"
  echo "|---|---|---:|---:|"
  cat "$WORK/stages.md"
} >"$MD" 2>>"$LOG"
rm -rf "$WORK"
echo "gpu_check: $MD ($(elapsed) s)"
