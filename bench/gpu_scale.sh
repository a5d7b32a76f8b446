#!/usr/bin/env bash
# Issue 18 on one machine of several GPUs, one call: weak scaling of the GRPO step through the worker
# (N = 1, 2, 4, 8 up to the machine's GPUs, 32 prompts x 8 per GPU at every N) and tensor- against
# data-parallel rollout of a 7B-shaped model over all the GPUs (tp 1, 2, 4, 8 up to them).
#   [NS="1 4 2 1 4"] [STEPS=5] [SET="key=value ..."] bash bench/gpu_scale.sh OUT_DIR [MAX_GPUS] [all|worker|tp]
# (SET: config overrides for the worker runs, e.g. SET=rl.rollout.logprob_check_freq=1000 to check only the first sync and the last step)
# Needs pydantic on the image (carried in .whl/, installed here into /tmp/pyd when missing). Each run's console
# goes to OUT_DIR/*.log; the JSON results to OUT_DIR/w (gpu-worker-rR-nN.json, R the run's number) and OUT_DIR/tpK (gpu-tp-rollout.json).
set -uo pipefail
out=$1
gpus=${2:-$(nvidia-smi -L | wc -l)}
parts=${3:-all}
mkdir -p "$out"
if ! python3 -c "import pydantic" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/pyd .whl/*.whl
fi
export PYTHONPATH=/tmp/pyd:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,uuid,memory.total --format=csv,noheader | tee "$out/gpus.txt"
run=0
for n in ${NS:-1 2 4 8}; do  # NS="1 4 2 1 4": the runs in that order (a repeated N gets the next run's number)
    [ "$parts" != tp ] || break
    [ "$n" -le "$gpus" ] || continue
    run=$((run + 1))
    start=$(date +%s)
    timeout 300 torchrun --nproc_per_node="$n" bench/gpu_worker.py --out "$out/w" --name "gpu-worker-r$run" \
        --prompts 32 --steps "${STEPS:-5}" --warmup 1 ${SET:+--set $SET} > "$out/worker-r$run-n$n.log" 2>&1
    echo "worker run $run N=$n exit $? after $(( $(date +%s) - start )) s: $(grep 'tokens/s' "$out/worker-r$run-n$n.log" | tail -1)"
done
for k in 1 2 4 8; do
    [ "$k" -le "$gpus" ] && [ "$parts" != worker ] || break
    start=$(date +%s)
    timeout 150 torchrun --nproc_per_node="$gpus" bench/gpu_tp_rollout.py --out "$out/tp$k" --tp "$k" --shape 7b \
        > "$out/tp$k.log" 2>&1
    echo "7b tp=$k exit $? after $(( $(date +%s) - start )) s: $(grep 'generated tok/s' "$out/tp$k.log" | tail -1)"
done
