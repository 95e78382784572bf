"""Does the fused-MoE kernel care where the kept experts lie in the weight tensor?

The step profile found vLLM's `cpu_fused_moe` slower per step in the colocated engine (the full 64-expert
tensor, decode tokens routed to 32 kept experts) than in the packed pruned checkpoint (a 32-expert
tensor), for the same number of experts read (figures: docs/results/performance.md). This isolates the
kernel: the `cpu` bench preset's shapes (8 MoE layers, hidden 1024, experts of 512, top-4, bf16), one call
per layer per step as in a decode step, three weight layouts:

- packed:     a 32-expert tensor, tokens routed among all 32 (the pruned checkpoint);
- scattered:  the 64-expert tensor, tokens routed among 32 experts spread over it (colocated SlimWise today);
- contiguous: the 64-expert tensor, tokens routed among its first 32 experts (colocated with the kept experts
              permuted to the front of the tensor at load time).
- full:       the 64-expert tensor, tokens routed among all 64 (the full model), for scale.

Routing is drawn at random per step and layer, the same draws for every layout (ids mapped into each layout's
expert numbering); rounds rotate the layout order. Prints ms per step (8 layers), median and range.

  python -m experiments.moe_layout --batch 8 32 --rounds 7 --steps 40 --out runs/moe-layout
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

LAYOUTS = ("packed", "scattered", "contiguous", "full")


def build(layers: int, experts: int, hidden: int, inter: int, dtype: torch.dtype, seed: int) -> dict:
    """Per layer: the 64-expert weights prepacked for the kernel, the packed 32-expert weights of the same
    kept experts, the contiguous (kept-first) permutation of the 64, and the kept ids."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    g = torch.Generator().manual_seed(seed)
    out = {
        "w13": [],
        "w2": [],
        "w13_packed": [],
        "w2_packed": [],
        "w13_front": [],
        "w2_front": [],
        "kept": [],
    }
    for _ in range(layers):
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.02).to(dtype)
        kept = torch.randperm(experts, generator=g)[: experts // 2].sort().values
        kept_set = set(kept.tolist())
        front = torch.cat([kept, torch.tensor([e for e in range(experts) if e not in kept_set])])
        for key, a, b in (("", w13, w2), ("_packed", w13[kept], w2[kept]), ("_front", w13[front], w2[front])):
            out["w13" + key].append(cpu_prepack_moe_weight(a.contiguous(), "vec"))
            out["w2" + key].append(cpu_prepack_moe_weight(b.contiguous(), "vec"))
        out["kept"].append(kept)
    return out


def step(weights: dict, layout: str, x: torch.Tensor, choice: list[torch.Tensor], topw: torch.Tensor) -> None:
    """One decode step's MoE calls: `choice[layer]` holds per token top-k positions into the kept list (or,
    for `full`, expert ids of the 64)."""
    from vllm._custom_ops import cpu_fused_moe

    out = torch.empty_like(x)
    for layer, pick in enumerate(choice):
        if layout == "full":
            ids, w13, w2 = pick, weights["w13"][layer], weights["w2"][layer]
        elif layout == "packed":
            ids, w13, w2 = pick, weights["w13_packed"][layer], weights["w2_packed"][layer]
        elif layout == "contiguous":
            ids, w13, w2 = pick, weights["w13_front"][layer], weights["w2_front"][layer]
        else:
            ids, w13, w2 = weights["kept"][layer][pick], weights["w13"][layer], weights["w2"][layer]
        cpu_fused_moe(out, x, w13, w2, None, None, topw, ids.to(torch.int32).contiguous(), "silu", "vec")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=40, help="decode steps per layout per round")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    weights = build(args.layers, args.experts, args.hidden, args.inter, torch.bfloat16, args.seed)
    half = args.experts // 2
    rows = []
    for batch in args.batch:
        g = torch.Generator().manual_seed(args.seed + batch)
        x = (torch.randn(batch, args.hidden, generator=g) * 0.1).to(torch.bfloat16)
        topw = torch.full((batch, args.topk), 1.0 / args.topk)
        times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
        for r in range(args.rounds + 1):  # round 0 warms up
            draws = [[torch.stack([torch.randperm(half, generator=g)[: args.topk] for _ in range(batch)])
                      for _ in range(args.layers)] for _ in range(args.steps)]
            full_draws = [
                [
                    torch.stack(
                        [torch.randperm(args.experts, generator=g)[: args.topk] for _ in range(batch)]
                    )
                    for _ in range(args.layers)
                ]
                for _ in range(args.steps)
            ]
            order = LAYOUTS[r % len(LAYOUTS):] + LAYOUTS[: r % len(LAYOUTS)]
            for layout in order:
                t0 = time.perf_counter()
                for s in range(args.steps):
                    step(weights, layout, x, full_draws[s] if layout == "full" else draws[s], topw)
                ms = (time.perf_counter() - t0) / args.steps * 1e3
                if r:
                    times[layout].append(ms)
        for layout in LAYOUTS:
            t = times[layout]
            rows.append({"batch": batch, "layout": layout, "ms_per_step": statistics.median(t), "min": min(t),
                         "max": max(t), "rounds": t})
            print(
                f"B={batch:3d} {layout:10s} {statistics.median(t):7.2f} ms/step ({min(t):.2f}-{max(t):.2f})",
                flush=True,
            )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe-layout.json").write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
