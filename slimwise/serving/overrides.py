"""The `hf_overrides` that make vLLM serve a checkpoint with SlimWise: the SlimWise model class and the plan,
delta, gates and budget keys its `DecodeRouting` reads (`slimwise.serving.routing`), each path-valued key with
a hash of the content it names beside it.

Shared by every consumer that starts a vLLM engine (the offline `VllmEngine`, `slimwise serve`, the bench), so
serving never reaches into the engines for them.
"""

from __future__ import annotations

import json
from pathlib import Path

from slimwise.decode_gates import PLAIN, DecodeGates
from slimwise.delta import delta_dir
from slimwise.errors import SlimWiseError
from slimwise.fingerprint import content_sha256
from slimwise.plan import PrunePlan
from slimwise.serving.models import CPU_ROPE_FIX, STOCK_ARCHS, slimwise_arch
from slimwise.serving.routing import (
    BUDGET_KEY,
    COUNT_EXPERTS_KEY,
    DEFAULT_PLAN_KEY,
    DELTA_KEY,
    FALLBACK_KEY,
    GATES_KEY,
    LOG_EVERY_KEY,
    MASK_ALL_KEY,
    MIN_BATCH_KEY,
    PLAN_KEY,
    PLANS_KEY,
    PRUNED_GATES_KEY,
    SUBSTITUTES_KEY,
)

PlanLike = PrunePlan | str | Path


#: the SlimWise overrides whose value is a path (PLANS_KEY: a dict of paths or plans): each gets a hash of the
#: content it names beside it, under KEY + SHA256_SUFFIX (`with_content_hashes`)
PATH_KEYS = (PLAN_KEY, PLANS_KEY, DELTA_KEY, SUBSTITUTES_KEY, PRUNED_GATES_KEY)
SHA256_SUFFIX = "_sha256"


def with_content_hashes(overrides: dict) -> dict:
    """`overrides` with a content hash beside every path-valued SlimWise override (`slimwise_plan_sha256`,
    `slimwise_plans_sha256` {name: hash}, `slimwise_delta_sha256`, `slimwise_substitutes_sha256`,
    `slimwise_pruned_gates_sha256`); a path with nothing there gets none (the engine refuses it at load).

    Why: vLLM's compile caches key on the hf_config, where these overrides land, so a path alone would let
    a plan or delta rewritten at the same path reuse an artefact compiled for the old one. Verified in vLLM
    0.32: `aot_compile_hash_factors` (vllm/compilation/caching.py) and `VllmBackend.__call__`
    (vllm/compilation/backends.py) hash `VllmConfig.compute_hash()`, which takes `ModelConfig.compute_hash()`
    (vllm/config/model.py); its `get_hash_factors` covers every dataclass field but `ignored_factors` (which
    hold `hf_overrides`, not `hf_config`), and `normalize_value` (vllm/config/utils.py) renders `hf_config`
    by `to_json_string()`, whose diff dict keeps every key a default `PretrainedConfig` lacks: each
    `slimwise_*` key, these hashes included. The SlimWise classes read their keys by name
    (`slimwise.serving.routing`), so the hashes change nothing else."""
    out = dict(overrides)
    for key in PATH_KEYS:
        value = overrides.get(key)
        if isinstance(value, str):
            digest = content_sha256(delta_dir(value))
            if digest is not None:
                out[key + SHA256_SUFFIX] = digest
        elif key == PLANS_KEY and isinstance(value, dict):  # each a path, or the plan itself (its content)
            digests = {name: content_sha256(delta_dir(v)) for name, v in value.items() if isinstance(v, str)}
            digests = {name: d for name, d in digests.items() if d is not None}
            if digests:
                out[key + SHA256_SUFFIX] = digests
    return out


def _plan_value(plan: PlanLike) -> dict | str:
    return plan.to_dict() if isinstance(plan, PrunePlan) else str(Path(plan).resolve())


def _stock_arch(model_dir: str | Path) -> str:
    """The checkpoint's vLLM architecture, refused unless SlimWise has a class for it."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    if arch not in STOCK_ARCHS:
        raise SlimWiseError(
            f"architecture {arch!r} has no SlimWise vLLM class; supported: {', '.join(STOCK_ARCHS)}"
        )
    return arch


def pruned_gates_overrides(decode_dir: str | Path, gates_file: str | Path) -> dict:
    """The `hf_overrides` of a pruned checkpoint's decode instance that decodes with `--gates drop` or
    `substitute`: SlimWise's class and the gates file (`slimwise.gate_sidecar`)."""
    return with_content_hashes({"architectures": [slimwise_arch(_stock_arch(decode_dir))],
                                PRUNED_GATES_KEY: str(Path(gates_file).resolve())})


def slimwise_overrides(
    model_dir: str | Path,
    plan: PlanLike | dict[str, PlanLike] | None,
    *,
    mask_all: bool = False,
    min_decode_batch: int = 0,
    log_every: int = 0,
    delta: str | Path | None = None,
    default_plan: str | None = None,
    gates: DecodeGates = PLAIN,
    count_experts: bool = False,
) -> dict:
    """The `hf_overrides` that turn a stock checkpoint into a SlimWise-served one. `plan` a dict: several
    named plans in one engine, each request choosing its own (`default_plan`: for requests that name none; a
    plan's name or "full"; default the first)."""
    arch = _stock_arch(model_dir)
    if plan is None:  # the full model: stock, except where the SlimWise class carries a vLLM CPU fix
        return {"architectures": [slimwise_arch(arch)]} if slimwise_arch(arch) in CPU_ROPE_FIX else {}
    if isinstance(plan, dict):
        plans = {
            "architectures": [slimwise_arch(arch)],
            PLANS_KEY: {k: _plan_value(v) for k, v in plan.items()},
        }
        if default_plan is not None:
            plans[DEFAULT_PLAN_KEY] = default_plan
    else:
        plans = {"architectures": [slimwise_arch(arch)], PLAN_KEY: _plan_value(plan)}
    out = {**plans, MASK_ALL_KEY: mask_all, MIN_BATCH_KEY: min_decode_batch, LOG_EVERY_KEY: log_every}
    if delta is not None:
        out[DELTA_KEY] = str(Path(delta).resolve())
    if not gates.plain:
        out[GATES_KEY], out[FALLBACK_KEY] = gates.gates, gates.fallback
    if gates.budgeted:
        out[BUDGET_KEY] = {k: v for k, v in gates.describe().items()
                           if k in ("budget", "budget_share", "extra")}
    if gates.substitutes:
        out[SUBSTITUTES_KEY] = str(Path(gates.substitutes).resolve())
    if count_experts:  # per-layer counters of experts touched and fallbacks (eager engines; a sync per layer)
        out[COUNT_EXPERTS_KEY] = True
    return with_content_hashes(out)


def full_model_overrides(model_dir: str | Path) -> dict:
    """`hf_overrides` for the unpruned model: none, or the SlimWise class (no plan) where it fixes vLLM on
    CPU."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (config.get("architectures") or [None])[0]
    return slimwise_overrides(model_dir, None) if arch in STOCK_ARCHS else {}
