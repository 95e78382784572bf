"""`slimwise distill`'s own options (`DistillCommand`), around the trainer's (declared by the fields of
`slimwise.distill.DistillConfig`): the model, the plan, the prompts, the output and the teacher data, declared
once (`slimwise.options`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimwise.argtypes import integer
from slimwise.load_options import DTYPES, DeviceOptions, ModelOptions, dry_run_field


@dataclass
class DistillCommand(DeviceOptions, ModelOptions):
    """MODEL (trained in its own dtype default: float32 on the CPU, the published bars), the plan, the prompts
    and the delta directory, then how the teacher data is made and kept."""

    dtype: str | None = field(default=None, kw_only=True, metadata={
        "choices": DTYPES, "help": "weights dtype for training (default: float32 on the CPU, bf16 on a GPU)"})
    plan: str = field(kw_only=True, metadata={
        "required": True, "help": "the prune plan JSON to distil the decoder of"})
    data: str = field(kw_only=True, metadata={
        "required": True, "help": "calibration prompts: .jsonl ('prompt' field), .txt or a directory"})
    out: str = field(kw_only=True, metadata={
        "required": True, "help": "delta directory to write (delta.safetensors + delta.json)"})
    # the prompts' limit, applied as they load: DistillConfig.max_samples (and the delta's record) stays None
    max_samples: int | None = field(default=None, metadata={"type": integer(1), "help": None})
    teacher: str | None = field(default=None, metadata={
        "help": "teacher-data file (.pt) shared between runs on the same model and data: built and written "
                "there if absent, reused (and checked) if present"})
    teacher_engine: str = field(default="hf", metadata={
        "choices": ["hf", "vllm"],
        "help": "who builds the teacher data (the full model's continuations and log-probs): hf (the "
                "transformers model) or vllm (generation and teacher-forced log-probs in vLLM, before the "
                "student loads). With vllm, unknown options go to vLLM"})
    teacher_top_k: int | None = field(default=None, metadata={
        "type": integer(1),
        "help": "with --teacher-engine vllm: keep vLLM's top K log-probs per position and spread the rest "
                "evenly (default: the whole vocabulary, exact)"})
    force: bool = field(default=False, metadata={"help": "replace a non-empty output"})
    dry_run: bool = dry_run_field()

