"""SlimWise: decode-only expert pruning for MoE serving.

The public Python API, importable from `slimwise` itself (loaded on first use, so `import slimwise` stays
cheap and vLLM workers, which import `slimwise.serving`, never load the trainer or the evaluation):

    from slimwise import load_model, load_tokenizer, calibrate, CalibrationConfig, plan_from_stats
    from slimwise import PhaseSplitEngine, GenerationConfig, export_pruned, distill, DistillConfig

Stages, in pipeline order: data -> models/adapters -> calibrate (ExpertStats) -> criteria -> plan -> export |
generate (reference engine) + masking + delta -> distill -> evaluation -> perf. docs/architecture.md has one
line per module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_API: dict[str, str] = {
    "SlimWiseError": "slimwise.errors",
    "load_prompts": "slimwise.data",
    "load_records": "slimwise.data",
    "load_model": "slimwise.models",
    "load_tokenizer": "slimwise.models",
    "resolve_model_dir": "slimwise.models",
    "get_adapter": "slimwise.adapters",
    "register_adapter": "slimwise.adapters",
    "MoEAdapter": "slimwise.adapters",
    "calibrate": "slimwise.calibrate",
    "CalibrationConfig": "slimwise.calibrate",
    "continuation_stats": "slimwise.calibrate",
    "footprint": "slimwise.footprint",
    "ExpertStats": "slimwise.stats",
    "CRITERIA": "slimwise.criteria",
    "register_criterion": "slimwise.criteria",
    "score_experts": "slimwise.criteria",
    "plan_from_stats": "slimwise.criteria",
    "PrunePlan": "slimwise.plan",
    "make_plan": "slimwise.plan",
    "ExpertMask": "slimwise.masking",
    "export_pruned": "slimwise.export",
    "load_pruned": "slimwise.export",
    "export_checkpoint": "slimwise.export_stream",
    "stream_pruned": "slimwise.export_stream",
    "PhaseSplitEngine": "slimwise.engines.reference",
    "GenerationConfig": "slimwise.engines.reference",
    "Generation": "slimwise.engines.reference",
    "Delta": "slimwise.delta",
    "apply_delta": "slimwise.delta",
    "fold_delta": "slimwise.delta",
    "continuation_logprobs": "slimwise.scoring",
    "divergence": "slimwise.scoring",
    "distill": "slimwise.distill",
    "DistillConfig": "slimwise.distill",
    "build_teacher": "slimwise.distill",
    "TeacherData": "slimwise.distill",
    "EvalConfig": "slimwise.evaluation",
    "run_eval": "slimwise.evaluation",
    "Sweep": "slimwise.evaluation",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'slimwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from slimwise.adapters import MoEAdapter, get_adapter, register_adapter  # noqa: F401
    from slimwise.calibrate import CalibrationConfig, calibrate  # noqa: F401
    from slimwise.criteria import CRITERIA, plan_from_stats, register_criterion, score_experts  # noqa: F401
    from slimwise.data import load_prompts, load_records  # noqa: F401
    from slimwise.delta import Delta, apply_delta, fold_delta  # noqa: F401
    from slimwise.distill import DistillConfig, TeacherData, build_teacher, distill  # noqa: F401
    from slimwise.engines.reference import Generation, GenerationConfig, PhaseSplitEngine  # noqa: F401
    from slimwise.errors import SlimWiseError  # noqa: F401
    from slimwise.evaluation import EvalConfig, Sweep, run_eval  # noqa: F401
    from slimwise.export import export_pruned, load_pruned  # noqa: F401
    from slimwise.export_stream import export_checkpoint, stream_pruned  # noqa: F401
    from slimwise.masking import ExpertMask  # noqa: F401
    from slimwise.models import load_model, load_tokenizer, resolve_model_dir  # noqa: F401
    from slimwise.plan import PrunePlan, make_plan  # noqa: F401
    from slimwise.scoring import continuation_logprobs, divergence  # noqa: F401
    from slimwise.stats import ExpertStats  # noqa: F401
