"""What a testbed training run varies (`TrainConfig`), and the one declaration of the options of
`python -m lab.testbed.train`: a field's metadata makes it an option (slimwise.options)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from lab.testbed.backbones import BACKBONES, DEFAULT_FAMILY_WEIGHTS
from lab.testbed.fast_experts import FAST_EXPERTS
from slimwise.argtypes import integer, number
from slimwise.options import argument_text

#: the options before --no-eval, in the order --help lists them and a model card's command spells them
#: (`evaluate.train_command`): what the run starts from, its budget, its processes, the tokenizer and rows,
#: the optimiser, the data, then evaluation
TRAIN_OPTIONS = ("backbone", "out", "init_from", "model_overrides", "minutes", "max_steps", "seed", "resume",
                 "threads", "ranks", "pair_init", "spaced_pairs", "row_groups", "packing", "seq_len", "lr",
                 "warmup_steps", "optimizer", "samples_per_family", "long_max_length", "long_top_share",
                 "family_weights", "experts_implementation", "eval_n_per_family", "heldout_n_per_family")
#: spelled on a card's command even at their defaults
#: how a run of this trainer is invoked, recorded in its train_summary.json (its card prints it)
ENTRY = "python -m lab.testbed.train"
ALWAYS_SPELLED = ("backbone", "out", "seed")


def _family_weights(text: str) -> dict[str, float]:
    """--family-weights gcd=2,base=1.5 -> {"gcd": 2.0, "base": 1.5}"""
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def _model_overrides(items: list[str]) -> dict:
    """--override field=value ... (JSON values) -> {field: value}"""
    return {key: json.loads(value) for key, _, value in (item.partition("=") for item in items)}


def _family_weights_text(weights: dict[str, float]) -> list[str]:
    """The inverse of _family_weights."""
    return [",".join(f"{k}={argument_text(v)}" for k, v in weights.items())]


def _model_overrides_text(overrides: dict) -> list[str]:
    """The inverse of _model_overrides: one `field=value` per --override, compact JSON."""
    return [f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in overrides.items()]


@dataclass
class TrainConfig:
    """A training run. The metadata of a field makes it an option of `python -m lab.testbed.train`
    (slimwise.options)."""

    backbone: str = field(default="a", metadata={
        "choices": sorted(BACKBONES), "required": True, "help": None})
    out: str = field(default="runs/testbed-a", metadata={
        "required": True, "help": "output directory (model, tokenizer, log, resumable state)"})
    minutes: float | None = field(default=45.0, metadata={  # None: max_steps only
        "type": float, "help": "hard wall-clock budget of the training loop"})
    # schedule length in steps (None: the time budget alone)
    max_steps: int | None = field(default=None, metadata={"type": int, "help": None})
    seed: int = field(default=0, metadata={"type": int, "help": None})
    # continued training: the weights, config and tokenizer of a trained model of the same backbone, with
    # --override applied to its config (e.g. a longer max_position_embeddings)
    init_from: str | None = field(default=None, metadata={
        "help": "start from this trained model directory (or embedded name) instead of a fresh init"})
    resume: bool = field(default=False, metadata={"help": "continue from OUT/train_state.pt"})
    model_overrides: dict = field(default_factory=dict, metadata={  # backbone config fields (tests, sweeps)
        "flag": "--override", "action": "append", "convert": _model_overrides,
        "render": _model_overrides_text,
        "help": "model config field=value (JSON value)"})
    # data
    # per step and family, freshly generated; ~2k tokens per step at the defaults
    samples_per_family: int = field(default=3, metadata={"type": int, "help": None})
    # multipliers of samples_per_family, per family
    family_weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_FAMILY_WEIGHTS), metadata={
        "convert": _family_weights, "render": _family_weights_text,
        "help": "e.g. gcd=2,base=1.5 (default: DEFAULT_FAMILY_WEIGHTS)"})
    # long-prompt families (long_tasks.LONG_FAMILIES) join the stream when --family-weights gives them a
    # weight; each sample's prompt length is drawn from [MIN_LENGTH, long_max_length] characters
    long_max_length: int = field(default=1024, metadata={
        "type": integer(1), "help": "longest long-family prompt in the training stream, in characters"})
    # the rest are log-uniform (long_tasks.draw_long_samples), so the last positions are the rarest
    long_top_share: float = field(default=0.0, metadata={
        "type": number(0, 1),
        "help": "share of long-family samples drawn uniformly from the top octave of prompt lengths"})
    seq_len: int = field(default=256, metadata={
        "type": integer(1),
        "help": "packed row length in tokens (at least the longest sample: 140 in the train split)"})
    packing: str = field(default="auto", metadata={  # "packed": rows of seq_len; "rows": one sample per row
        "choices": ("auto", "packed", "rows"),
        "help": "auto: one sample per row for hybrid (linear-attention) models, packed rows otherwise; "
                "packed on a hybrid resets the Gated-DeltaNet state at every sample "
                "(packed_linear_attention)"})
    row_groups: int = field(default=3, metadata={  # each padded to its own longest sample
        "type": integer(1),
        "help": "row packing: length-sorted micro-batches per step (more: less padding, more calls)"})
    prompt_loss_weight: float = 0.0  # the prompt is masked; >0 trains on it with this weight
    # start " Bob" and "Bob" (same word with/without a leading space) from equal rows
    pair_init: bool = field(default=True, metadata={"help": "random rows for ' word' / 'word' token pairs"})
    spaced_pairs: bool = field(default=True, metadata={  # see build_tokenizer
        "help": "no ' Name' tokens beside 'Name': a qa name is one token in passage and solution alike"})
    # optimisation
    lr: float = field(default=2e-3, metadata={"type": float, "help": None})
    min_lr_ratio: float = 0.05
    warmup_steps: int = field(default=100, metadata={  # a continued run has warm weights: fewer
        "type": int, "help": "linear lr warmup steps before the cosine"})
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.02
    optimizer: str = field(default="adamw", metadata={
        "choices": ("adamw", "muon"),
        "help": "muon: Muon on hidden matrices and expert stacks, AdamW on the rest "
                "(lab/testbed/muon.py)"})
    # runtime
    threads: int = field(default=0, metadata={  # re-measured every 100 steps (see ThreadTuner)
        "type": int, "help": "torch threads; 0 = auto (1 or 2, re-measured)"})
    ranks: int = field(default=1, metadata={  # measured in cpu_parallel.py
        "type": integer(1),
        "help": "data-parallel processes of one thread each (see lab/testbed/cpu_parallel.py)"})
    experts_implementation: str = field(default=FAST_EXPERTS, metadata={
        "flag": "--experts-impl", "help": f"{FAST_EXPERTS} | grouped_mm | eager | ..."})
    checkpoint_minutes: float = 5.0
    checkpoint_every_steps: int | None = None  # in addition to the time-based checkpoints (tests)
    stop_at_step: int | None = None  # stop early (an interruption), leaving a resumable state (tests)
    log_every: int = 10
    progress: bool = field(default=True, metadata={"help": None})
    # final evaluation and model card
    eval_n_per_family: int = field(default=100, metadata={
        "flag": "--eval-n", "type": int, "help": "test prompts per family"})
    heldout_n_per_family: int = field(default=50, metadata={"flag": "--heldout-n", "type": int, "help": None})
    eval_batch_size: int = 32

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
