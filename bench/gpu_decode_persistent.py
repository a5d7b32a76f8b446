"""The decode step's MLP half as one persistent kernel, against the engine's four kernels (0.5B shape, M = 256).

    python3 bench/gpu_decode_persistent.py --out $OUT       # on the GPU machine; writes gpu-decode-persistent.json
    python3 bench/gpu_decode_persistent.py --out $OUT --per-sm 3 4 --bm 64 --stages 2 3    # more programs a SM

The engine runs a layer's MLP as four kernels: the residual add + RMSNorm (inductor), gate/up (cuBLAS), SiLU x up
(inductor), down (cuBLAS): ~28 us on an H100, of which the weights' bytes are ~8 us. The small matmuls cost ~4 us
whether their weights come from HBM or L2 (bench/gpu_decode_l2.py). Here one launch of 1-4 programs per SM does the
same work in three phases with grid-wide waits between them (results, slower: 2026-11-28-gpu-decode-l2-persistent-
layout.md):

  0. rows of h + delta: the new residual stream, its RMSNorm (transformers' order of operations), the fp32 output
     zeroed;
  A. gate/up tiles over the normed rows, silu(gate) * up in the epilogue (each rounded to bf16 as torch does);
  B. down tiles, K split in SPLIT chunks, fp32 partial sums added into the output with atomics.

Also: the cost of an empty kernel in a CUDA graph (a chain of 192 one-element adds), i.e. the floor of what any
kernel of the step costs. Every figure: 24 layers, each with its own weights (from HBM, as in the step), one CUDA
graph, median of 5 replays, us per layer. Results are checked against the engine's compiled `mlp` first.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_common import graph_seconds, machine  # noqa: E402
from stages.rollout.cuda_model import mlp  # noqa: E402

M, HIDDEN, INTER, LAYERS, EPS = 256, 896, 4864, 24, 1e-6


@triton.jit
def _grid_wait(SYNC, target):
    """Every program of the grid has arrived here `target / grid` times: all their stores are visible after it."""
    tl.debug_barrier()
    tl.atomic_add(SYNC, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _mlp_kernel(H, DELTA, G, WGU, WD, XN, ACT, OUT, H_OUT, SYNC, eps, M, HID: tl.constexpr, HP: tl.constexpr,
                INTER: tl.constexpr, PROGS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                BMB: tl.constexpr, BNB: tl.constexpr, BKB: tl.constexpr, SPLIT: tl.constexpr,
                STAGES: tl.constexpr):
    pid = tl.program_id(0)
    dtype = H.dtype.element_ty
    # phase 0: residual add, RMSNorm, output zeroed
    c = tl.arange(0, HP)
    cm = c < HID
    g = tl.load(G + c, mask=cm, other=0.0)
    for r in range(pid, M, PROGS):
        x = (tl.load(H + r * HID + c, mask=cm, other=0.0) + tl.load(DELTA + r * HID + c, mask=cm, other=0.0))
        x = x.to(dtype)
        tl.store(H_OUT + r * HID + c, x, mask=cm)
        xf = x.to(tl.float32)
        rr = tl.rsqrt(tl.sum(xf * xf, 0) / HID + eps)
        tl.store(XN + r * HID + c, (g.to(tl.float32) * (xf * rr).to(dtype).to(tl.float32)).to(dtype), mask=cm)
        tl.store(OUT + r * HID + c, tl.zeros([HP], tl.float32), mask=cm)
    _grid_wait(SYNC, PROGS)
    # phase A: act = silu(xn @ gate.T) * (xn @ up.T)
    tiles_n = INTER // BN
    for item in range(pid, (M // BM) * tiles_n, PROGS):
        rm = (item // tiles_n) * BM + tl.arange(0, BM)
        rn = (item % tiles_n) * BN + tl.arange(0, BN)
        gate = tl.zeros([BM, BN], tl.float32)
        up = tl.zeros([BM, BN], tl.float32)
        for k0 in tl.range(0, HID, BK, num_stages=STAGES):
            rk = k0 + tl.arange(0, BK)
            a = tl.load(XN + rm[:, None] * HID + rk[None, :], cache_modifier=".cg")
            wg = tl.load(WGU + rn[:, None] * HID + rk[None, :])
            wu = tl.load(WGU + (rn + INTER)[:, None] * HID + rk[None, :])
            gate = tl.dot(a, tl.trans(wg), gate)
            up = tl.dot(a, tl.trans(wu), up)
        gf = gate.to(dtype).to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(dtype).to(tl.float32)
        act = (silu * up.to(dtype).to(tl.float32)).to(dtype)
        tl.store(ACT + rm[:, None] * INTER + rn[None, :], act)
    _grid_wait(SYNC, 2 * PROGS)
    # phase B: out += act[:, chunk] @ down[:, chunk].T
    tiles_nb = HID // BNB
    chunk = tl.cdiv(INTER, SPLIT * BKB) * BKB
    for item in range(pid, (M // BMB) * tiles_nb * SPLIT, PROGS):
        s = item % SPLIT
        t = item // SPLIT
        rm = (t // tiles_nb) * BMB + tl.arange(0, BMB)
        rn = (t % tiles_nb) * BNB + tl.arange(0, BNB)
        acc = tl.zeros([BMB, BNB], tl.float32)
        end = tl.minimum((s + 1) * chunk, INTER)
        for k0 in tl.range(s * chunk, end, BKB, num_stages=STAGES):
            rk = k0 + tl.arange(0, BKB)
            km = (rk < end)[None, :]
            a = tl.load(ACT + rm[:, None] * INTER + rk[None, :], mask=km, other=0.0, cache_modifier=".cg")
            w = tl.load(WD + rn[:, None] * INTER + rk[None, :], mask=km, other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
        tl.atomic_add(OUT + rm[:, None] * HID + rn[None, :], acc, sem="relaxed")


class PersistentMLP:
    """Buffers for one layer's call; `sync` holds a counter a layer, zeroed once per step."""

    def __init__(self, layers: int, progs: int, config: dict):
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        self.xn, self.h_out = torch.empty(M, HIDDEN, **kw), torch.empty(M, HIDDEN, **kw)
        self.act = torch.empty(M, INTER, **kw)
        self.out = torch.empty(M, HIDDEN, device="cuda", dtype=torch.float32)
        self.sync = torch.zeros(layers, device="cuda", dtype=torch.int32)
        self.progs, self.config = progs, config

    def _args(self, layer: int, h, delta, norm_w, gate_up_w, down_w) -> tuple[tuple, dict]:
        c = self.config
        return ((h, delta, norm_w, gate_up_w, down_w, self.xn, self.act, self.out, self.h_out, self.sync[layer:], EPS,
                 M), dict(HID=HIDDEN, HP=triton.next_power_of_2(HIDDEN), INTER=INTER, PROGS=self.progs, BM=c["bm"],
                          BN=c["bn"], BK=c["bk"], BMB=c["bmb"], BNB=c["bnb"], BKB=c["bkb"], SPLIT=c["split"],
                          STAGES=c["stages"], num_warps=c["warps"]))

    def per_sm(self, *inputs) -> dict:
        """How many programs of this configuration fit on one SM at once (compiles, does not run: a grid that
        does not fit all at once would wait forever at its first grid-wide wait), its registers and shared bytes."""
        args, kwargs = self._args(0, *inputs)
        k = _mlp_kernel.warmup(*args, grid=(self.progs,), **kwargs)
        k._init_handles()  # loads it: n_regs
        sm = torch.cuda.get_device_properties(0)
        threads = self.config["warps"] * 32
        regs = -(-k.n_regs * 32 // 256) * 256 * self.config["warps"]  # allocated per warp in units of 256
        fit = min(sm.regs_per_multiprocessor // regs, sm.max_threads_per_multi_processor // threads,
                  sm.shared_memory_per_multiprocessor // (k.metadata.shared + 1024))  # 1 KB reserved a block
        return {"fit_per_sm": fit, "n_regs": k.n_regs, "shared": k.metadata.shared}

    def __call__(self, layer: int, *inputs):
        args, kwargs = self._args(layer, *inputs)
        _mlp_kernel[(self.progs,)](*args, **kwargs)
        return self.h_out, self.out


def graph_us(step, layers: int) -> float:
    """us per layer of step() (which runs all layers) replayed in one CUDA graph."""
    return graph_seconds(step) / layers * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--quick", action="store_true", help="one configuration")
    p.add_argument("--per-sm", type=int, nargs="+", default=[1, 2], help="programs a SM (grid = SMs x this)")
    p.add_argument("--bm", type=int, nargs="+", default=[64, 128], help="phase A's rows a tile")
    p.add_argument("--stages", type=int, nargs="+", default=[3], help="K-loop pipeline stages")
    args = p.parse_args()
    torch.manual_seed(0)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    h, delta = torch.randn(M, HIDDEN, **kw), torch.randn(M, HIDDEN, **kw)
    norm = [(torch.rand(HIDDEN, **kw) + 0.5) for _ in range(LAYERS)]
    gate_up = [torch.randn(2 * INTER, HIDDEN, **kw) * 0.03 for _ in range(LAYERS)]
    down = [torch.randn(HIDDEN, INTER, **kw) * 0.015 for _ in range(LAYERS)]
    compiled = torch.compile(mlp, fullgraph=True)
    result = {"machine": machine(), "sms": torch.cuda.get_device_properties(0).multi_processor_count, "runs": []}

    ref_h, ref_out = compiled(h, delta, norm[0], gate_up[0], down[0], EPS)

    def engine_us() -> float:
        return graph_us(lambda: [compiled(h, delta, norm[i], gate_up[i], down[i], EPS) for i in range(LAYERS)], LAYERS)

    result["engine_us"] = [engine_us()]

    one = torch.zeros(1, device="cuda")
    result["empty_kernel_us"] = graph_us(lambda: [one.add_(1) for _ in range(8 * LAYERS)], 8 * LAYERS)

    configs = [dict(bm=bm, bn=64, bk=64, bmb=64, bnb=bnb, bkb=64, split=split, stages=stages, warps=warps)
               for bm, bnb, split, warps, stages in itertools.product(args.bm, (64, 32), (4, 2), (4, 8), args.stages)]
    configs = configs[:1] if args.quick else configs
    sms = result["sms"]
    for config, per_sm in itertools.product(configs, args.per_sm):
        run = {**config, "progs": sms * per_sm}
        try:
            fn = PersistentMLP(LAYERS, sms * per_sm, config)
            run.update(fn.per_sm(h, delta, norm[0], gate_up[0], down[0]))
            if run["fit_per_sm"] < per_sm:
                raise RuntimeError(f"{per_sm} programs a SM do not fit at once")
            fn.sync.zero_()
            got_h, got_out = fn(0, h, delta, norm[0], gate_up[0], down[0])
            torch.cuda.synchronize()
            run["h_equal"] = bool(torch.equal(got_h, ref_h))
            err = (got_out - ref_out.float()).abs().max().item()
            run["max_abs_diff"], run["ref_abs_max"] = err, ref_out.float().abs().max().item()
            if not run["h_equal"] or err > 0.02 * run["ref_abs_max"]:  # the reference is bf16: ~1 ulp apart
                raise AssertionError("differs from the engine's mlp: not timed")

            def step(fn=fn):
                fn.sync.zero_()
                for i in range(LAYERS):
                    fn(i, h, delta, norm[i], gate_up[i], down[i])

            run["us"] = graph_us(step, LAYERS)
        except Exception as exc:  # a configuration that does not compile, fit or agree: recorded, not timed
            run["error"] = repr(exc)[:300]
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    result["engine_us"].append(engine_us())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-decode-persistent.json").write_text(json.dumps(result, indent=1))
    ok = [r for r in result["runs"] if "us" in r]
    best = sorted(ok, key=lambda r: r["us"])[:5]
    print(f"engine's four kernels: {result['engine_us']} us a layer; empty kernel {result['empty_kernel_us']:.2f} us")
    for r in best:
        print(f"persistent {r['us']:.2f} us  {r}")


if __name__ == "__main__":
    main()
