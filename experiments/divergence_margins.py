"""Where a pruned or distilled decoder's greedy output first leaves the full model's, and how sure the \
full model
was there.

Why: the problems whose length changes under distillation (5-8% on testbed-b) set how faithful any decoder
can be. At a problem's first divergence the full model's own log-prob gap between its token and the one the
student took says whether the student overruled a clear choice or broke a near-tie that any approximation of
the full model would break. Runs sample 0 of the test split (1,000 problems) with the plans and SlimWise
deltas of a finished `python -m experiments.distill_bars bars` run:

    python -m experiments.divergence_margins testbed-b --run runs/distill-bars7/testbed-b/testbed-b \
        --ratios 0.25 0.5
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from experiments.distill_bars import BarsConfig
from slimwise.delta import Delta
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.models import load_model, load_tokenizer
from slimwise.plan import PrunePlan
from slimwise.scoring import logprobs_along
from slimwise.testbed import TARGET_DOMAIN, make_split

EDGES = (0.1, 0.5, 1.0, 2.0)  # nats


def first_divergence(a: list[int], b: list[int]) -> tuple[int, int]:
    """(index, b's token there) of the first position where b leaves a; (-1, -1) if b equals a or only stops
    or runs on at a's end."""
    for j, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return j, y
    return -1, -1


def shares(values: np.ndarray) -> str:
    return " | ".join(f"{100 * float((values < e).mean()):.1f}%" for e in EDGES)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--run", required=True, help="a bars output folder holding plan-RATIO.json and the deltas")
    p.add_argument("--ratios", nargs="+", default=["0.25", "0.5"])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype="float32"), load_tokenizer(args.model)
    cfg = BarsConfig()
    gen = GenerationConfig(max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size)
    samples = make_split("test", cfg.test_per_family, domain=TARGET_DOMAIN)
    engine = PhaseSplitEngine(model, tok)
    ids = engine.encode([s.prompt for s in samples])
    reference = [g.token_ids for g in engine.generate(ids, mode="full", config=gen)]
    # the full model's, along its own tokens
    logprobs = logprobs_along(engine, ids, reference, cfg.batch_size)
    top2 = [lp.topk(2, dim=-1).values for lp in logprobs]
    base = torch.cat([t[:, 0] - t[:, 1] for t in top2]).numpy()  # the base rate of near-ties, every position
    header = " | ".join(f"< {e:g}" for e in EDGES)
    print(
        f"| ratio | mode | outputs that change | first divergences where the full model's gap is {header} "
        f"nats | of them at a gap >= {EDGES[-1]:g} |"
    )
    print("|---|---|---|" + "---|" * (len(EDGES) + 1))
    for ratio in args.ratios:
        plan = PrunePlan.load(Path(args.run) / f"plan-{ratio}.json")
        delta = Delta.load(Path(args.run) / f"delta-distilled-{ratio}")
        for mode, with_delta in (("slimwise", None), ("distilled", delta)):
            with PhaseSplitEngine(model, tok, plan=plan, delta=with_delta) as eng:
                # one mask on the model at a time
                outs = [g.token_ids for g in eng.generate(ids, mode=mode, config=gen)]
            div = [first_divergence(r, o) for r, o in zip(reference, outs, strict=True)]
            changed = sum(r != o for r, o in zip(reference, outs, strict=True))
            # the full model's preference for its own token over the student's at the first divergence
            gaps = np.asarray(
                [
                    float(lp[j, r[j]] - lp[j, t])
                    for lp, r, (j, t) in zip(logprobs, reference, div, strict=True)
                    if j >= 0
                ]
            )
            clear = int((gaps >= EDGES[-1]).sum())
            print(f"| {ratio} | {mode} | {changed} | {shares(gaps)} | {clear} |", flush=True)
    print(
        f"| all positions | full model's top-1 minus top-2 gap ({len(base):,} positions) | "
        f"| {shares(base)} | |"
    )


if __name__ == "__main__":
    main()
