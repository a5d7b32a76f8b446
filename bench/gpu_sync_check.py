"""Where the weight-sync check's time goes: the engine's wake, its greedy tokens on the two check prompts, the
trainer's re-scoring (`engine_diff`) and the sleep, each timed with the device synchronised between them.

    torchrun --nproc_per_node=1 bench/gpu_sync_check.py [--repeats 4] [gpu_worker.py's options]
    PYTHONPATH=. .venv/bin/torchrun --nproc_per_node=1 bench/gpu_sync_check.py --quick     # CPU smoke test

The worker and workload are bench/gpu_worker.py's; two GRPO steps run first (compilation, graph capture).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())

from bench.gpu_worker import Bench, parse_args, reduce_step  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    repeats = 4
    if "--repeats" in argv:
        i = argv.index("--repeats")
        repeats, argv = int(argv[i + 1]), argv[:i] + argv[i + 2:]
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    os.environ["CUDA_VISIBLE_DEVICES"] = "" if args.quick else os.environ["LOCAL_RANK"]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    from stages.rollout.base import SamplingParams

    bench = Bench(args, rank, world)
    for _ in range(2):
        reduce_step(bench.run())
    worker, prompts = bench.worker, bench.prompts(0)[:2]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    params = SamplingParams(n=1, temperature=0.0,
                            max_tokens=min(worker.rl.rollout.logprob_check_tokens, worker.cfg.data.max_response_length))
    for rep in range(repeats):
        marks = [time.perf_counter()]

        def mark():
            sync()
            marks.append(time.perf_counter())

        worker.engine.wake()
        mark()
        outs = worker.generate(prompts, params)
        mark()
        worker.engine_diff(prompts, outs)
        mark()
        worker.engine.sleep()
        mark()
        ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
        if rank == 0:
            stats = worker.engine.stats
            print(f"repeat {rep}: wake {ms[0]:.1f} ms, generate {ms[1]:.1f} ms (prefill {stats['prefill_s'] * 1e3:.1f} "
                  f"ms, {stats['decode_steps']} decode steps), engine_diff {ms[2]:.1f} ms, sleep {ms[3]:.1f} ms, "
                  f"total {sum(ms):.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
