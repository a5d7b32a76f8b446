#!/usr/bin/env bash
# The flow end to end on a lent GPU machine (Ray, Prefect, the `cuda` engine): what a GPU user runs.
#
# The lent machines have torch and transformers but not Ray, Prefect, DuckDB, datasets or s3fs, and cannot
# reach a registry; those travel as cp312 wheels, tarred and split into parts of ~55 MB carried one per call.
# The parts, built here: the closure of ray, prefect, duckdb, datasets, s3fs, math_verify and pydantic in this
# venv minus what the image has (102 wheels on 2026-11-24, listed in bench/results/2026-11-24-gpu-flow.md), then
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ... \
#       -d gpuwhl -r needed.txt && tar cf gpuwhl.tar gpuwhl && split -b 54600000 gpuwhl.tar gpuwhl.part.
# Usage, on the GPU machine:
#   bash bench/gpu_flow.sh PARTS_DIR OUT_DIR [recipe overrides...]
# RECIPE=recipes/gpu_tool_calc.yaml picks another recipe (default recipes/gpu_demo.yaml).
# PARTS_DIR holds gpuwhl.part.* (skipped when /tmp/site is installed already); OUT_DIR gets the console,
# the run's logs, metrics and report (no weights).
set -euo pipefail
parts=$1 out=$2
shift 2
if [ ! -f /tmp/site/.installed ]; then
    mkdir -p /tmp/wheels
    cat "$parts"/gpuwhl.part.* | tar xf - -C /tmp/wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        /tmp/wheels/gpuwhl/*.whl
    touch /tmp/site/.installed
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 WANDB_MODE=offline
python3 -c "import torch, transformers, ray, prefect, duckdb; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'ray', ray.__version__, 'prefect', prefect.__version__, 'duckdb', duckdb.__version__,
torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
start=$(date +%s)
status=0
python3 -m flows.post_train "${RECIPE:-recipes/gpu_demo.yaml}" "$@" 2>&1 | tee "$out/console.log" || status=$?
echo "flow exit status $status after $(( $(date +%s) - start )) s" | tee -a "$out/console.log"
run=$(ls -td outputs/runs/*/ | head -1)
tar czf "$out/run.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.distcp' --exclude='*.bin' \
    --exclude=tmp "$run" outputs/store
exit "$status"
