#!/usr/bin/env bash
# One command for a bare GPU machine (torch + triton present, no internet): install the wheels that
# `make gpu-wheels` put into gpu-wheels/, run the GPU tests and the benchmarks, and leave logs, JSON and PNG in
# OUT_DIR. Every stage runs even when an earlier one fails; the summary (OUT_DIR/summary.tsv) says which failed.
#
#   tools/gpu_check.sh OUT_DIR [--dry-run] [--only STAGE[,STAGE...]] [--skip STAGE[,STAGE...]]
#
# Environment: PYTHON (default python3), TAPETRAIN_GPU_WHEELS (default ./gpu-wheels),
# TAPETRAIN_GPU_SITE (where the wheels are installed, default /tmp/tapetrain-gpu-site).
set -uo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-2}"; }
[[ $# -ge 1 && $1 != -* ]] || usage
OUT=$1
shift
DRY=0
ONLY=""
SKIP=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --only) ONLY=${2:?--only needs a list}; shift ;;
    --skip) SKIP=${2:?--skip needs a list}; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gpu_check: unknown argument $1" >&2; usage ;;
  esac
  shift
done

REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${TAPETRAIN_GPU_WHEELS:-$REPO/gpu-wheels}
SITE=${TAPETRAIN_GPU_SITE:-/tmp/tapetrain-gpu-site}
BENCH="$PY $REPO/tools/benchmark.py"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# name | time limit (s) | command. The limits add up to about 44 minutes, more than a short device session: pick
# stages with --only (the H200 session of 2026-11-26 ran the gpu tests, layer-32k, layer-32k-tiled, docmask-155m).
STAGES=(
  "install|120|install_wheels"
  "env|60|describe_machine"
  "gpu-tests|330|$PY -m pytest -m gpu -q -p no:cacheprovider --timeout=300 --junitxml=$OUT/gpu-tests.xml $REPO/tests"
  "kernel-tune|150|$PY $REPO/tools/tune_attention.py --budget-s ${TAPETRAIN_TUNE_BUDGET_S:-30} --head-dims ${TAPETRAIN_TUNE_DIMS:-64,128} --out $OUT/kernel-tune.json"
  "attention-d64|120|$BENCH attention --head-dim 64 --heads 16 --batch 4 --seq-lens 1024,2048,4096,8192 --out $OUT/attention-d64.json"
  "attention-d128|120|$BENCH attention --head-dim 128 --heads 16 --batch 2 --seq-lens 1024,2048,4096,8192 --out $OUT/attention-d128.json"
  "train-155m|150|$BENCH train --preset paper-155m --seq-len 1024 --batch 16 --steps 20 --warmup 5 --out $OUT/train-paper-155m.json"
  "train-155m-compile|240|$BENCH train --preset paper-155m --seq-len 1024 --batch 16 --steps 20 --warmup 5 --set compile=true --out $OUT/train-paper-155m-compile.json"
  "train-1b|200|$BENCH train --preset llama-1b --seq-len 2048 --batch 8 --steps 10 --warmup 3 --out $OUT/train-llama-1b.json"
  "train-1b-compile|300|$BENCH train --preset llama-1b --seq-len 2048 --batch 8 --steps 10 --warmup 3 --set compile=true --out $OUT/train-llama-1b-compile.json"
  "profile-1b|240|$PY $REPO/tools/profile_step.py --preset llama-1b --seq-len 2048 --batch 8 --set compile=true --out $OUT/profile-llama-1b-compile.json"
  "engine-155m|150|$BENCH engine --preset paper-155m --seq-len 1024 --batch 16 --zero-stage 2 --steps 10 --warmup 3 --out $OUT/engine-paper-155m.json"
  "layer-memory|120|$BENCH layer --preset llama2-7b --seq-len 8192 --out $OUT/layer-llama2-7b.json"
  "layer-32k|120|$BENCH layer --preset llama2-7b --seq-len 32768 --set tiled_mlp=0 --out $OUT/layer-llama2-7b-32k-tiled-0.json"
  "layer-32k-tiled|120|$BENCH layer --preset llama2-7b --seq-len 32768 --set tiled_mlp=auto --out $OUT/layer-llama2-7b-32k-tiled-auto.json"
  "docmask-155m|120|$BENCH docmask --preset paper-155m --seq-len 8192 --docs 8 --pairs 30 --warmup 3 --out $OUT/docmask-paper-155m-8192.json"
)

install_wheels() {
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl)
  if [[ ${#wheels[@]} -eq 0 ]]; then
    echo "no wheels in $WHEELS (run 'make gpu-wheels' on a machine with internet and copy gpu-wheels/ here)"
    return 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"
}

describe_machine() {
  nvidia-smi || true
  "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name() if torch.cuda.is_available() else "none")
for name in ("triton", "deepspeed", "transformers", "flash_attn", "liger_kernel", "sentencepiece"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as err:  # absent optional packages are expected
        print(name, "absent", type(err).__name__)
EOF
}

wanted() {
  local name=$1
  if [[ -n $ONLY && ",$ONLY," != *",$name,"* ]]; then return 1; fi
  if [[ -n $SKIP && ",$SKIP," == *",$name,"* ]]; then return 1; fi
  return 0
}

if [[ $DRY -eq 1 ]]; then
  echo "gpu_check dry run: would write into $OUT"
  echo "  wheels from $WHEELS into $SITE (PYTHONPATH=$SITE:$REPO)"
  for entry in "${STAGES[@]}"; do
    IFS='|' read -r name limit cmd <<<"$entry"
    wanted "$name" && echo "  [$name] (limit ${limit}s) $cmd"
  done
  exit 0
fi

export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# deepspeed picks the CUDA accelerator itself; keep its JIT builds and Triton's cache inside OUT_DIR's machine tmp
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tapetrain-triton-cache}

SUMMARY=$OUT/summary.tsv
printf 'stage\trc\tseconds\tlog\n' >"$SUMMARY"
failed=0
for entry in "${STAGES[@]}"; do
  IFS='|' read -r name limit cmd <<<"$entry"
  wanted "$name" || continue
  log=$OUT/$name.log
  echo "== $name (limit ${limit}s)"
  start=$(date +%s.%N)
  if declare -F "${cmd%% *}" >/dev/null; then
    ( $cmd ) >"$log" 2>&1 &
  else
    timeout --signal=TERM --kill-after=10 "$limit" bash -c "$cmd" >"$log" 2>&1 &
  fi
  wait $!
  rc=$?
  secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$(basename "$log")" >>"$SUMMARY"
  tail -n 25 "$log"
  echo "-- $name: rc=$rc in ${secs}s"
  [[ $rc -eq 0 ]] || failed=$((failed + 1))
done

echo
column -t -s $'\t' "$SUMMARY" 2>/dev/null || cat "$SUMMARY"
if [[ $failed -gt 0 ]]; then
  echo "gpu_check: $failed stage(s) failed; logs in $OUT"
  exit 1
fi
echo "gpu_check: all stages passed; results in $OUT"
