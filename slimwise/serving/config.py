"""What `slimwise serve` starts (`ServeConfig`), and the one declaration of its options: a field's metadata
makes it an option of `slimwise serve` (slimwise.options). Kept apart from server.py so that building the
command line imports no vLLM, transformers or HTTP client."""

from __future__ import annotations

from dataclasses import dataclass, field

from slimwise.argtypes import gib_to_bytes, integer, number
from slimwise.decode_gates import GateOptions
from slimwise.serving.validation import MAX_N_DEFAULT


@dataclass
class ServeConfig(GateOptions):
    """One `slimwise serve`: the model, its plan(s), colocated or disaggregated, and the endpoint. `--plan` is
    read by `slimwise.cli.serve_plans` into `plan` (one unnamed plan) or `plans` (named ones)."""

    model: str = field(metadata={"flag": "model", "help": "the full model's checkpoint directory"})
    plan: str | None = None
    # several plans in one colocated engine, each exposed as model name MODEL:NAME (MODEL: the default plan)
    plans: dict[str, str] = field(default_factory=dict)
    default_plan: str | None = field(default=None, metadata={  # a name of `plans`, or "full"
        "metavar": "NAME|full",
        "help": "with named plans: the plan of requests to plain MODEL (default: the first plan)"})
    delta: str | None = field(default=None, metadata={
        "flag": "--distilled", "help": "decode-only delta from `slimwise distill`"})
    disaggregated: bool = field(default=False, metadata={
        "help": "full-model prefill instance + pruned decode instance + proxy behind one endpoint"})
    decode_model: str | None = field(default=None, metadata={  # exported if absent
        "help": "pruned checkpoint for the decode instance (default: exported from --plan)"})
    prefill_url: str | None = field(default=None, metadata={
        "help": "attach the proxy to a prefill instance started elsewhere"})
    decode_url: str | None = field(default=None, metadata={
        "help": "attach the proxy to a decode instance started elsewhere"})
    nixl: bool = field(default=False, metadata={  # forward NixlConnector's remote-decode transfer params
        "help": "attached instances use NixlConnector (GPU); see docs/serving.md"})
    host: str = field(default="127.0.0.1", metadata={"help": None})
    port: int = field(default=8000, metadata={
        "type": integer(1, 65535), "help": "endpoint port (disaggregated: instances on port+1, +2)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model name clients use (both instances share it; default: the embedded name as typed, e.g. "
                "testbed-c, or the checkpoint directory's name)"})
    min_decode_batch: int = field(default=0, metadata={
        "type": integer(0),
        "help": "load-aware: use the pruned experts only when a step has at least this many decode tokens"})
    log_every: int = field(default=0, metadata={
        "type": integer(0), "help": "log routing counters every N steps (0: never)"})
    vllm_args: list[str] = field(default_factory=list)
    startup_timeout: float = 900.0
    kv_dir_max_bytes: int | None = field(default=None, metadata={  # None: the proxy's 4 GiB
        "flag": "--kv-dir-max-gb", "type": number(0, lo_open=True), "convert": gib_to_bytes,
        "help": "--disaggregated: cap of the shared KV directory in GB (default 4); over it, new requests "
                "get 503 with Retry-After"})
    # the folded decode checkpoints (pruned/) and gates files (gates/) of --disaggregated, keyed by content
    decode_cache_dir: str = field(default="~/.cache/slimwise", metadata={
        "metavar": "DIR",
        "help": "--disaggregated: where the exported decode checkpoints (one per model, plan and delta "
                "content, each as large as the pruned model) and gates files are kept; nothing is deleted "
                "automatically (default %(default)s)"})
    # completions per request (`n`); more gets 400 (colocated middleware and proxy alike)
    max_n: int = field(default=MAX_N_DEFAULT, metadata={
        "type": integer(1),
        "help": "most completions one request may ask for (n); more gets 400 (default %(default)s; the "
                "disaggregated proxy serves n=1 only)"})

