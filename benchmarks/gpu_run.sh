#!/usr/bin/env bash
# The GPU benchmarks and tests in one command that fits a 10-minute slot on one H100 / H200 (at most ~9.5 minutes):
#   structured_gpu.py   structured pruning at Llama-3.1-8B / Llama-3.2-1B / Qwen3-8B shapes (budget 230 s)
#   semi_structured.py  where the time of PyTorch's 2:4 path goes, one projection and whole models (budget 130 s)
#   the CUDA tests      tests/test_cuda.py and tests/test_gpu_benchmarks.py (at most 150 s)
# Each script stops starting work when its budget is spent and rewrites its results file after every group, so a
# run cut short keeps what it measured; `timeout` bounds each one.
#
#   bash benchmarks/gpu_run.sh --prepare-wheels   # here, before: the wheels `import optimum_prune` may lack there
#   bash benchmarks/gpu_run.sh                    # on the GPU machine, from the repository root
#
# Results go to $OUT (the device machine's returned folder) or, without it, benchmarks/results/.
set -uo pipefail
PY=${PYTHON:-python3}
WHEELS=.whl   # ignored by git; carried to the device machine

if [ "${1:-}" = "--prepare-wheels" ]; then
    # The pure-Python dependencies of `import optimum_prune` that the device image lacks, at the versions installed here.
    specs=$($PY -c "import importlib.metadata as m; print(' '.join(f'{d}=={m.version(d)}' for d in ('datasets', 'dill', 'multiprocess', 'gguf')))")
    mkdir -p "$WHEELS"
    exec $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $specs
fi

OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import optimum_prune" 2>/dev/null && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
$PY -c "import optimum_prune" || { echo "optimum_prune does not import here: run --prepare-wheels and carry $WHEELS"; exit 3; }
{ date -u; nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv; \
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"; } \
  2>&1 | tee "$OUT/gpu_run.log"

timeout 290 $PY benchmarks/structured_gpu.py --budget-s 230 --output-dir "$OUT" 2>&1 | tee -a "$OUT/gpu_run.log"
echo "structured_gpu.py exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_run.log"
timeout 180 $PY benchmarks/semi_structured.py --budget-s 130 --output-dir "$OUT" 2>&1 | tee -a "$OUT/gpu_run.log"
echo "semi_structured.py exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_run.log"
timeout 150 $PY -m pytest tests/test_cuda.py tests/test_gpu_benchmarks.py -q -p no:cacheprovider 2>&1 \
    | tail -40 > "$OUT/gpu_tests.log"
echo "CUDA tests exit ${PIPESTATUS[0]}: $(tail -1 "$OUT/gpu_tests.log")" | tee -a "$OUT/gpu_run.log"
