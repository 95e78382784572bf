"""What `slimwise bench` measures (`BenchConfig`), the one declaration of its options (a field's metadata
makes it an option, slimwise.options), and the synthetic presets' names. Standard library only, so that
building the bench (and the lab's roofline) parsers imports neither torch nor transformers (checked by a
test)."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimwise.argtypes import gib_to_bytes, integer, number
from slimwise.decode_gates import GateOptions

# kept literal (slimwise.perf.presets imports transformers); a test checks they match the presets
PRESET_NAMES = ("cpu", "cpu-hybrid", "cpu-shared", "qwen3-30b-a3b", "qwen3.6-35b-a3b", "smoke")
DEFAULT_BATCHES = (1, 4, 8, 16, 32, 64, 128, 256)
BASE_VARIANTS = ("full", "slimwise", "pruned", "uniform")
GATED = "gated"  # slimwise with --gates / --fallback / --substitutes, beside the plain slimwise variant
VARIANTS_HELP = ("full | slimwise | pruned | uniform | slimwise-minN (load-aware: prune only on steps with "
                 ">= N decode tokens) | mix-P (one engine with two plans: P%% of requests on the plan, the "
                 "rest on --plan-b) | mixfull-P (the rest on full) | gated (slimwise with --gates, "
                 "--fallback, --substitutes); default: full slimwise pruned uniform")


def _hardware(name: str) -> str | None:
    return None if name == "none" else name


@dataclass
class BenchConfig(GateOptions):
    """What to benchmark and how. Exactly one of `model` (a checkpoint) and `synthetic` (a preset name)."""

    model: str | None = field(default=None, metadata={
        "flag": "model", "nargs": "?", "help": "full model checkpoint directory (or use --synthetic)"})
    synthetic: str | None = field(default=None, metadata={
        "choices": PRESET_NAMES, "help": "random-weight model of a real configuration"})
    layers: int | None = field(default=None, metadata={
        "type": integer(1), "help": "--synthetic: layer count (default: the preset's build default)"})
    top_k: int | None = field(default=None, metadata={
        "type": integer(1), "help": "--synthetic: routed experts per token (default: the preset's), so that "
                                    "a trained model's plan, which names its top-k, runs on these sizes"})
    routing_skew: str | None = field(default=None, metadata={
        "help": "--synthetic: calibration stats whose usage shares the routers follow"})
    synthetic_dir: str | None = field(default=None, metadata={  # runs/synthetic-<preset>[...]
        "help": "--synthetic: build/reuse directory (default runs/synthetic-PRESET...)"})
    plan: str | None = field(default=None, metadata={  # random: seeded
        "help": "plan JSON (default: from --stats, else random per layer at --ratio)"})
    plan_b: str | None = field(default=None, metadata={
        "help": "mix variants' second plan (default: random per layer at the plan's ratio, seed+1)"})
    stats: str | None = field(default=None, metadata={  # this model's, or usage shares for synthetic
        "help": "calibration stats for the plan"})
    criterion: str = field(default="reap", metadata={
        "help": "with --stats of this model (default %(default)s)"})
    ratio: float = field(default=0.5, metadata={
        "type": number(0, 1, hi_open=True), "help": "share of experts pruned (default %(default)s)"})
    pruned_model: str | None = field(default=None, metadata={
        "help": "exported pruned checkpoint (default: exported into --out/pruned)"})
    variants: tuple[str, ...] = field(default=BASE_VARIANTS, metadata={
        "nargs": "+", "convert": tuple, "help": VARIANTS_HELP})
    batches: tuple[int, ...] = field(default=DEFAULT_BATCHES, metadata={
        "flag": "--batch", "type": integer(1), "nargs": "+", "convert": tuple,
        "help": "decode batch sizes (default 1 4 8 16 32 64 128 256)"})
    prompt_len: int = field(default=32, metadata={"type": integer(1), "help": None})
    output_len: int = field(default=128, metadata={"type": integer(2), "help": None})
    repetitions: int = field(default=3, metadata={
        "type": integer(1), "help": "interleaved rounds (default %(default)s)"})
    warmup_tokens: int = field(default=8, metadata={
        "type": integer(0), "help": "tokens of the warm-up generate per batch"})
    # resolved per machine (slimwise.hardware.resolve_dtype) before any engine starts
    dtype: str = field(default="auto", metadata={
        "choices": ["bfloat16", "float16", "float32", "auto"],
        "help": "auto: the checkpoint's dtype (synthetic presets: bf16), but float32 on a CPU without bf16 "
                "matrix instructions (slimwise.hardware); the choice and the machine are in bench.json"})
    enforce_eager: bool = field(default=True, metadata={
        "flag": "--compile", "help": "let vLLM compile (default: enforce_eager)"})
    kv_cache_bytes: int | None = field(default=None, metadata={  # default: what the largest batch needs, +25%
        "flag": "--kv-cache-gb", "type": number(0, lo_open=True), "convert": gib_to_bytes,
        "help": "KV cache per engine (default: what the largest batch needs)"})
    max_num_batched_tokens: int | None = field(default=None, metadata={  # one prefill step
        "type": integer(1), "help": "default: max batch x prompt length"})
    restart: bool = field(default=False, metadata={
        "help": "one engine alive at a time, restarted every round (when the engines do not fit together)"})
    resume: bool = field(default=False, metadata={  # resident mode
        "help": "keep the batches a crashed run of the same settings saved in OUT/bench.partial.json"})
    in_process: bool = field(default=False, metadata={
        "help": "run the engine cores in this process: a resident engine that is not being measured runs "
                "nothing, where a subprocess engine core keeps polling (25-40%% of a core each)"})
    count_experts: bool = field(default=True, metadata={
        "flag": "--no-count", "help": "skip the expert-traffic pass"})
    count_output_len: int = field(default=16, metadata={
        "type": integer(1), "help": "tokens per sequence in the traffic pass"})
    hardware: str | None = field(default="cpu-measured", metadata={  # None: no prediction
        "convert": _hardware, "help": "roofline hardware (cpu-measured, h100, h200, none)"})
    kernel_roofline: bool = field(default=False, metadata={
        "help": "also time vLLM's CPU fused-MoE op at the model's expert shapes (about a minute) and predict "
                "each batch's pruned step from the measured full step (slimwise.perf.kernels)"})
    suggest_threshold: float | None = field(default=None, metadata={
        "type": number(0), "metavar": "MIN_SPEEDUP",
        "help": "print the smallest batch where SlimWise reaches this speedup (for --min-decode-batch)"})
    out_dir: str = field(default="runs/bench", metadata={
        "flag": "--out", "help": "output directory (bench.json, bench.md, bench.png)"})
    plot: str | None = field(default=None, metadata={"help": "PNG path (default OUT/bench.png)"})
    seed: int = field(default=0, metadata={"type": integer(0), "help": None})
    verbose: bool = field(default=False, metadata={"help": "keep vLLM's INFO logs"})
    # the `gated` variant's gates (slimwise.decode_gates); the other variants keep the plain ones

