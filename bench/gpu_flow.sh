#!/usr/bin/env bash
# The flow end to end on a lent GPU machine (Ray, Prefect, the `cuda` engine): what a GPU user runs.
#
# The lent machines have torch and transformers but not Ray, Prefect, DuckDB, datasets or s3fs, and cannot
# reach a registry; those travel as two parts of an xz tarball of the installed packages, built here and carried
# one per call (bench/gpu_site.sh says how).
# Usage, on the GPU machine:
#   bash bench/gpu_flow.sh PARTS_DIR OUT_DIR [recipe overrides...]
# RECIPE=recipes/gpu_tool_calc.yaml picks another recipe (default recipes/gpu_demo.yaml).
# PARTS_DIR holds gsite.part.aa and .ab (skipped when /tmp/gsite is there already); OUT_DIR gets the console,
# the run's logs, metrics and report (no weights).
set -euo pipefail
parts=$1 out=$2
shift 2
[ -d /tmp/gsite ] || bash bench/gpu_site.sh unpack "$parts"/gsite.part.aa "$parts"/gsite.part.ab
export PYTHONPATH=/tmp/gsite:$PWD PATH=/tmp/gsite/bin:$PATH PYTHONUNBUFFERED=1 WANDB_MODE=offline
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
