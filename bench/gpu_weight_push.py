"""The asynchronous modes' weight push on two GPUs: a trainer rank on GPU 0 broadcasts, a rollout worker's `cuda`
engine on GPU 1 loads the stream (stages/workers/weight_transfer.py over NCCL, as stages/rl_async.py pushes).

    python bench/gpu_weight_push.py --out DIR [--shapes 0.5b 7b] [--pushes 5]     # 2 GPUs
    PYTHONPATH=. python bench/gpu_weight_push.py --quick --out DIR                 # CPU, gloo, a tiny shape

Rank 0 builds a model of the shape with random bf16 weights (seed 0) and pushes its state dict (HF names, in order,
as `ActorRolloutWorker.send_weights` does). Rank 1 builds a `CudaRolloutEngine` from a model of the same shape seeded
differently, receives the push into it (`update_weights` on the stream: no second copy), and checks it against an
engine built from a seed-0 model of its own: greedy tokens and logprobs of 4 prompts must be equal. Timed per push:
rank 0's send, rank 1's receive + load; bytes / time. Needs only torch and transformers (no Ray, vLLM, pydantic).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import QWEN25_05B, TINY  # noqa: E402
from stages.rollout.base import SamplingParams  # noqa: E402
from stages.workers.weight_transfer import WeightGroup, weight_meta  # noqa: E402

QWEN25_7B = dict(QWEN25_05B, hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                 intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)
SHAPES = {"tiny": TINY, "0.5b": QWEN25_05B, "7b": QWEN25_7B}


def build(shape: str, seed: int, device: str):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=torch.bfloat16).eval()


def engine_of(model, device: str):
    from stages.rollout.cuda_engine import CudaRolloutEngine

    return CudaRolloutEngine(model, model.config.eos_token_id, max_num_seqs=8, max_model_len=128, device=device,
                             dtype=torch.bfloat16 if device.startswith("cuda") else None)


def greedy(engine, vocab: int) -> list[tuple[list[int], list[float]]]:
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, min(vocab, 1000), (16,), generator=generator).tolist() for _ in range(4)]
    outs = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_tokens=16))
    return [(o.response_ids, o.logprobs) for o in outs]


def worker(rank: int, args, port: int, out: Path) -> None:
    device = f"cuda:{rank}" if not args.quick else "cpu"
    if not args.quick:
        torch.cuda.set_device(rank)
    group = WeightGroup("127.0.0.1", port, rank, 2, torch.device(device), timeout_s=600)
    results = {}
    for shape in args.shapes:
        model = build(shape, 0 if rank == 0 else 1, device)
        meta = weight_meta(model.state_dict().items())
        engine = None if rank == 0 else engine_of(model, device)
        times = []
        for _ in range(args.pushes):
            if not args.quick:
                torch.cuda.synchronize()
            start = time.perf_counter()
            if rank == 0:
                sent = group.send(model.state_dict().items())
            else:
                engine.update_weights(group.receive(meta))
            if not args.quick:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        result = {"seconds": times, "median_s": statistics.median(times[1:] or times)}
        if rank == 0:
            result["gib"] = sent / 2**30
        else:
            pushed = greedy(engine, SHAPES[shape]["vocab_size"])
            del engine
            reference = greedy(engine_of(build(shape, 0, device), device), SHAPES[shape]["vocab_size"])
            result["equal_to_reference"] = pushed == reference
        results[shape] = result
        del model
        if not args.quick:
            torch.cuda.empty_cache()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    group.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "7b"])
    parser.add_argument("--pushes", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.shapes = ["tiny"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(worker, args=(args, port, out), nprocs=2)
    sender, receiver = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    device = "cpu (gloo)" if args.quick else torch.cuda.get_device_name(0) + " x2 (NCCL)"
    print(f"weight push, {device}, median of {args.pushes} pushes after the first")
    print("| shape | GiB | send s | receive + load s | GiB/s (receive) | engine equal to reference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for shape in args.shapes:
        s, r = sender[shape], receiver[shape]
        print(f"| {shape} | {s['gib']:.2f} | {s['median_s']:.4f} | {r['median_s']:.4f} | "
              f"{s['gib'] / r['median_s']:.1f} | {r['equal_to_reference']} |")
    (out / "weight_push.json").write_text(json.dumps({"device": device, "sender": sender, "receiver": receiver,
                                                      "argv": sys.argv, "time": time.strftime("%F %T")}))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
