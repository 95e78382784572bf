"""`SlimWiseConnector`: PD-disaggregated handoff where the prompt state and the first token are the full
model's.

Stock PD (ExampleConnector, NIXL) makes the decode instance recompute the tail of the prompt and sample the
first output token with its own weights; with a pruned decoder that breaks SlimWise's guarantee. Here the
proxy passes the prefill's first token t1 on, so the decode instance receives prompt P + [t1], and:

* producer (full model, prefill instance): stores the state of *every* prompt token of P, keyed by the hash of
  P: the KV blocks of each attention layer and, for hybrid models (Qwen3-Next, Qwen3.5/3.6-MoE), each
  linear-attention (Gated DeltaNet / Mamba) layer's conv state and recurrent state after the last token of P;
* consumer (pruned checkpoint, decode instance): finds the state stored for P = its prompt minus the last
  token, loads all of it, and computes only t1 itself -- exactly what colocated SlimWise does (t1 is fed back
  through the pruned decoder, whose linear-attention layers continue from the full model's state).

Storage is ExampleConnector's shared directory (safetensors per layer per prompt). Hybrid models need vLLM's
hybrid KV-cache manager, which a connector unlocks by implementing `SupportsHMA`: each KV-cache group (the
attention layers; groups of linear-attention layers) has its own block table, so requests carry one block list
per group. A linear-attention layer's cache is a (conv_state, ssm_state) pair indexed by the request's state
block: the first block of its group in Mamba cache mode "none" (prefix caching off), which both instances must
use. The prefill instance must run a prompt in one step (`--no-enable-chunked-prefill`);
`slimwise serve --disaggregated` passes both flags.

Tensor parallelism: each rank holds its shard of the KV heads (and of the linear-attention state), so each
rank stores and loads its own file, `<layer>.tp<size>-r<rank>.safetensors`, and the producer's ranks meet at a
barrier after storing, so the first token leaves the prefill instance only once every shard is on disk. Shards
are copied rank to rank, so both instances must run the same `--tensor-parallel-size`
(`slimwise serve --disaggregated` gives both the same options); a decode instance that finds a prompt stored
at another size refuses with a message naming the fix instead of decoding from the wrong shards. Pipeline
stages need nothing: their layers have distinct names.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, SupportsHMA
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
from vllm.logger import init_logger

from slimwise.errors import SlimWiseError

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.slimwise.connector")  # under "vllm" so vLLM's log config shows it


@dataclass
class PromptState:
    """One request's transfer: the first `len(token_ids)` positions, their blocks per KV-cache group."""

    token_ids: list[int]
    block_ids: tuple[list[int], ...]
    is_store: bool
    mm_hashes: list[str]


@dataclass
class SlimWiseConnectorMetadata(KVConnectorMetadata):
    requests: list[PromptState] = field(default_factory=list)


def _group_block_ids(block_ids) -> tuple[list[int], ...]:
    """vLLM passes one block list per KV-cache group (a tuple); older single-group code paths pass one
    list."""
    if block_ids and isinstance(block_ids[0], int):
        return (list(block_ids),)
    return tuple(list(b) for b in block_ids)


class SlimWiseConnector(ExampleConnector, SupportsHMA):
    """Whole-prompt storage on the producer, whole-prompt loading on the consumer: attention KV blocks and the
    linear-attention conv/recurrent state."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        # layer name -> (group index, tokens per block, is a linear-attention state layer)
        self._layers: dict[str, tuple[int, int, bool]] = {}
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
        for index, group in enumerate(groups):
            spec = group.kv_cache_spec
            state = type(spec).__name__ == "MambaSpec"
            for name in group.layer_names:
                self._layers[name] = (index, int(spec.block_size), state)
        if any(state for _, _, state in self._layers.values()):
            mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none")
            if mode != "none":
                raise SlimWiseError(
                    f"SlimWiseConnector hands over linear-attention state in Mamba cache mode 'none' only "
                    f"(this instance runs {mode!r}, set by prefix caching): start both instances with "
                    "--no-enable-prefix-caching"
                )

    # ----- worker side ---------------------------------------------------------------------------------
    # Whole blocks are copied, never individual token rows: the in-block layout is the attention backend's
    # business (CPU_ATTN keeps K transposed, [head_size, block_size], beside V as [block_size, head_size],
    # which ExampleConnector's row indexing scrambles). Both instances share block size, KV dtype and backend,
    # and slots past the prompt in the last block are rewritten by the decoder after the load.
    def _where(self, layer_name: str, request: PromptState, kv=None) -> tuple[list[int], bool]:
        """(rows of this layer's cache that hold the request's first len(token_ids) positions, is a state
        layer). `kv`: the layer's cache (first dimension: blocks). Where the attention kernel's blocks are
        smaller than the KV-cache manager's (vLLM views the cache as `num_blocks x ratio` kernel blocks, b
        being kernel blocks b*ratio .. b*ratio+ratio-1), the manager's blocks are mapped; any other layout is
        refused rather than copied from the wrong memory."""
        group, block_size, state = self._layers.get(layer_name, (0, self._block_size, False))
        blocks = request.block_ids[group]
        if state:  # Mamba cache mode "none": one state block per request, the first of its group
            return blocks[:1], True
        blocks = blocks[: -(-len(request.token_ids) // block_size)]
        rows = kv.shape[0] if isinstance(kv, torch.Tensor) else None
        if rows is None or not self._num_blocks or rows == self._num_blocks:
            return blocks, False
        if rows % self._num_blocks:
            raise SlimWiseError(f"SlimWiseConnector: layer {layer_name}'s KV cache has {rows} blocks for the "
                                f"manager's {self._num_blocks}, a layout it cannot map (a packed hybrid "
                                "cache?); use NixlConnector (slimwise serve --nixl, docs/serving.md)")
        ratio = rows // self._num_blocks
        return [b * ratio + j for b in blocks for j in range(ratio)], False

    def _cache_layers(self) -> dict[str, Any]:
        """Each layer's bound cache, from the config's static forward context: the layers a forward context
        would hold (`no_compile_layers` is the same dict), read without one, since Model Runner V2 calls
        `wait_for_save` after the forward (`post_forward`). A layer the KV-cache config names without a cache
        is refused: storing the others would hand a partial prompt state over."""
        layers = self._vllm_config.compilation_config.static_forward_context
        out = {}
        for name, layer in layers.items():
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, torch.Tensor) and kv.dim() >= 2:
                out[name] = kv
            elif isinstance(kv, (list, tuple)) and kv and all(isinstance(t, torch.Tensor) for t in kv):
                out[name] = tuple(kv)  # linear attention: (conv_state, ssm_state), first dim = state block
        missing = sorted(set(self._layers) - set(out))
        if missing:
            raise SlimWiseError(f"SlimWiseConnector: layers {missing[:3]} of the KV-cache config have no "
                                "bound cache in this worker; this vLLM model runner is not supported for PD "
                                "handoff")
        return out

    def _folder(self, token_ids: list[int], mm_hashes: list[str], create: bool = False) -> str:
        """A prompt's folder (hashed once per request, not once per layer)."""
        return self._generate_foldername_debug(torch.tensor(token_ids), mm_hashes, create_folder=create)

    @staticmethod
    def _rank() -> int:
        """This worker's tensor-parallel rank (worker side: known once distributed is up)."""
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        """Nothing per layer: `wait_for_save` stores every layer once the forward is done, so linear-attention
        layers (which never call this hook) are saved with their final state too."""

    def wait_for_save(self) -> None:
        stores = [r for r in self._get_connector_metadata().requests if r.is_store]
        if not stores:
            return
        layers = self._cache_layers()
        rank = self._rank()
        for request in stores:
            folder = self._folder(request.token_ids, request.mm_hashes, create=True)
            for layer_name, kv in layers.items():
                blocks, state = self._where(layer_name, request, kv)
                if state:
                    index = torch.tensor(blocks, device=kv[0].device)
                    tensors = {f"state_{i}": t[index].detach().cpu().contiguous() for i, t in enumerate(kv)}
                else:
                    tensors = {
                        "kv_cache": kv[torch.tensor(blocks, device=kv.device)].detach().cpu().contiguous()
                    }
                path = os.path.join(folder, state_file_name(layer_name, self._tp_size, rank))
                # unique per process: two writers never rename each other's file
                tmp = f"{path}.{os.getpid()}.tmp"
                safetensors.torch.save_file(tensors, tmp)
                os.replace(tmp, path)
        if self._tp_size > 1:  # rank 0 returns the first token: only once every rank's shard is stored
            from vllm.distributed import get_tp_group

            get_tp_group().barrier()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs) -> None:
        loads = [r for r in self._get_connector_metadata().requests if not r.is_store]
        if not loads:
            return
        layers = self._cache_layers()
        rank = self._rank()
        for request in loads:
            folder = self._folder(request.token_ids, request.mm_hashes)
            for layer_name, kv in layers.items():
                blocks, state = self._where(layer_name, request, kv)
                src = safetensors.torch.load_file(
                    os.path.join(folder, state_file_name(layer_name, self._tp_size, rank))
                )
                if state:
                    index = torch.tensor(blocks, device=kv[0].device)
                    for i, t in enumerate(kv):
                        t[index] = src[f"state_{i}"].to(t.device)
                else:
                    kv[torch.tensor(blocks, device=kv.device)] = src["kv_cache"].to(kv.device)

    def _stored(self, token_ids: list[int], mm_hashes: list[str]) -> bool:
        """Whether every rank's file of every layer is stored for this prompt at this instance's
        tensor-parallel size. A prompt stored only at another size is refused: its shards do not fit this
        instance's ranks."""
        folder = self._folder(token_ids, mm_hashes)
        names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
        if not self._layers:  # no KV-cache config (older single-group path): any file of this size
            return any(name.endswith(state_file_name("", self._tp_size, 0)) for name in names)
        want = {
            state_file_name(layer, self._tp_size, rank)
            for layer in self._layers
            for rank in range(self._tp_size)
        }
        if want <= names:
            return True
        sizes = {m.group(1) for name in names if (m := _TAG.search(name))} - {str(self._tp_size)}
        if sizes and not self._kv_transfer_config.is_kv_producer:
            raise SlimWiseError(
                f"SlimWiseConnector: the prefill instance stored this prompt's state at "
                f"--tensor-parallel-size {', '.join(sorted(sizes))} and this decode instance runs "
                f"{self._tp_size}; the connector copies each rank's shard to the same rank: start both "
                "instances with the same --tensor-parallel-size"
            )
        return False

    # ----- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self._kv_transfer_config.is_kv_producer:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2 or not self._stored(prompt[:-1], [f.identifier for f in request.mm_features]):
            return 0, False
        logger.info("SlimWise: loading the full model's state for %d prompt tokens", len(prompt) - 1)
        return max(len(prompt) - 1 - num_computed_tokens, 0), False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SlimWiseConnectorMetadata:
        meta = SlimWiseConnectorMetadata()
        producer = self._kv_transfer_config.is_kv_producer
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = list(new_req.prompt_token_ids or [])
            mm_hashes = [f.identifier for f in new_req.mm_features]
            blocks = _group_block_ids(new_req.block_ids)
            if new_req.req_id in self._requests_need_load:
                meta.requests.append(PromptState(token_ids[:-1], blocks, False, mm_hashes))
            elif producer and not self._stored(token_ids, mm_hashes):
                meta.requests.append(PromptState(token_ids, blocks, True, mm_hashes))
        self._requests_need_load.clear()
        return meta

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Saves are synchronous (`wait_for_save`), so blocks are free to go when a request finishes."""
        return False, None

    def _found_match_for_request(self, request: Request) -> bool:  # used by the base class's helpers
        prompt = list(request.prompt_token_ids or [])
        return self._stored(prompt[:-1], [f.identifier for f in request.mm_features])


_TAG = re.compile(r"\.tp(\d+)-r\d+\.safetensors$")


def state_file_name(layer_name: str, tp_size: int = 1, rank: int = 0) -> str:
    """The name of one layer's stored state, by one rank, in a prompt's folder (`proxy.kv_folder`); the size
    is part of the name, so a decode instance of another size sees the mismatch (`_TAG`)."""
    return f"{layer_name}.tp{tp_size}-r{rank}.safetensors"


def _nixl_connector():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlPullConnector

    return NixlPullConnector


def make_nixl_connector() -> type:
    """`SlimWiseNixlConnector`: vLLM's NixlConnector (pull) whose prefill side computes the *whole* prompt.

    For hybrid models (Mamba / Gated DeltaNet layers) stock NIXL makes the prefill instance drop the last
    prompt token (`_truncate_request_for_prefill`, `_prefill_backoff() == 1`): it hands over h(N-1) and the
    decode instance recomputes the last prompt token and samples the first output token with its own -- here
    pruned -- weights. The decode side already loads every prompt token but the last; SlimWise's proxy sends
    it `P + [t1]`, so that is all of P, *if* the prefill instance computed all of P. This subclass keeps the
    prefill request whole, so the transferred state is the full model's h(N) after P and t1 is the full
    model's token, as with `SlimWiseConnector` on CPU. Attention-only models are unaffected (their backoff is
    0). Designed from vLLM 0.32's NIXL code; not run here (NIXL needs CUDA): see docs/serving.md for what a
    GPU run must check.
    """
    base = _nixl_connector()

    class SlimWiseNixlConnector(base):
        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            scheduler = getattr(self, "connector_scheduler", None)
            if scheduler is not None:
                scheduler._truncate_request_for_prefill = _keep_whole_prompt

    SlimWiseNixlConnector.__module__ = __name__
    return SlimWiseNixlConnector


def _keep_whole_prompt(request) -> None:
    """Replaces NIXL's P-side truncation of hybrid prompts: the prefill instance computes every prompt
    token."""


def __getattr__(name: str):
    if name == "SlimWiseNixlConnector":
        cls = make_nixl_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
