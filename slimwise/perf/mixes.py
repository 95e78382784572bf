"""`slimwise bench`'s plan-mix variants: one engine holding two plans, each request of a batch on one of them.

`mix-P` sends P% of each batch's requests to plan a (the bench's plan) and the rest to plan b (`--plan-b`,
default a random plan at the same ratio); `mixfull-P` sends the rest to full (every expert). What they
measure: the decode speed of a several-plan engine (`slimwise serve --plan NAME=PLAN ...`) as the traffic
between its plans varies.
"""

from __future__ import annotations

from pathlib import Path

#: several plans in one engine (plans "a" = the bench's plan and "b" = --plan-b): `mix-P` sends P% of each
#: batch's requests to plan a and the rest to plan b; `mixfull-P` the rest to full (every expert)
MIX_PREFIXES = ("mix-", "mixfull-")


def mix_of(name: str) -> tuple[int, str] | None:
    """(percent of requests on plan a, the rest's plan) of a mix variant name, else None."""
    for prefix, rest in zip(MIX_PREFIXES, ("b", "full"), strict=True):
        value = name[len(prefix):]
        if name.startswith(prefix) and value.isdigit() and 0 <= int(value) <= 100:
            return int(value), rest
    return None


def variant_plans(variant, batch: int) -> list[str] | None:
    """Each request's plan name for a mix variant at `batch` (None: not a mix): the first round(P% x B) on
    plan a."""
    mix = variant.meta.get("mix")
    if mix is None:
        return None
    n_a = int(round(mix[0] / 100 * batch))
    return ["a"] * n_a + [mix[1]] * (batch - n_a)


def plan_b_path(config, model_dir: Path, plan_path: Path) -> Path:
    """The mix variants' second plan: --plan-b, else a random plan at the same ratio (seed + 1), made once."""
    import torch

    from slimwise.models import structure_model
    from slimwise.plan import PrunePlan, make_plan

    if config.plan_b:
        plan = PrunePlan.load(config.plan_b)
        plan.check_model(structure_model(model_dir), check_fingerprint=False)
    else:  # plan a's layers, sizes and fingerprint, other experts
        a = PrunePlan.load(plan_path)
        layers = sorted(a.kept_experts)
        scores = torch.rand(
            len(layers), a.num_experts, generator=torch.Generator().manual_seed(config.seed + 1)
        )
        plan = make_plan(scores, layers, a.ratio or config.ratio, family=a.family, top_k=a.top_k,
                         num_groups=a.num_groups, criterion="random", fingerprint=a.fingerprint,
                         meta={"seed": config.seed + 1})
    return plan.save(Path(plan_path).with_name("plan-b.json"))
