"""`SlimWiseConnector`: PD-disaggregated KV handoff where the prompt KV and the first token are the full model's.

Stock PD (ExampleConnector, NIXL) makes the decode instance recompute the tail of the prompt and sample the
first output token with its own weights; with a pruned decoder that breaks SlimWise's guarantee. Here the
proxy passes the prefill's first token t1 on, so the decode instance receives prompt P + [t1], and:

* producer (full model, prefill instance): stores the KV of *every* prompt token of P (not block-aligned),
  keyed by the hash of P;
* consumer (pruned checkpoint, decode instance): finds the KV stored for P = its prompt minus the last token,
  loads all len(P) positions, and computes only t1 itself — exactly what colocated SlimWise does (t1 is fed
  back through the pruned decoder).

Storage is ExampleConnector's shared directory (safetensors per layer per prompt). The prefill instance must
run a prompt in one step (`--no-enable-chunked-prefill`, which `slimwise serve --disaggregated` passes).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    ReqMeta,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.slimwise.connector")  # under "vllm" so vLLM's log config shows it


def _meta(token_ids: list[int], block_ids: list[int], block_size: int, is_store: bool, mm_hashes: list[str]):
    """ReqMeta for exactly len(token_ids) positions (ExampleConnector rounds down to whole blocks)."""
    n = len(token_ids)
    blocks = torch.tensor(block_ids)
    slots = (torch.arange(block_size)[None, :] + blocks[:, None] * block_size).flatten()[:n]
    return ReqMeta(token_ids=torch.tensor(token_ids), slot_mapping=slots, is_store=is_store, mm_hashes=mm_hashes)


class SlimWiseConnector(ExampleConnector):
    """ExampleConnector with whole-prompt storage on the producer and whole-prompt loading on the consumer."""

    # ----- worker side ---------------------------------------------------------------------------------
    # Whole blocks are copied, never individual token rows: the in-block layout is the attention backend's
    # business (CPU_ATTN keeps K transposed, [head_size, block_size], beside V as [block_size, head_size], which
    # ExampleConnector's row indexing scrambles). Both instances share block size, KV dtype and backend, and
    # slots past the prompt in the last block are rewritten by the decoder after the load.
    def _blocks(self, slot_mapping: torch.Tensor, device) -> torch.Tensor:
        return torch.unique_consecutive(slot_mapping // self._block_size).to(device)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs) -> None:
        for request in self._get_connector_metadata().requests:
            if request.is_store:
                kv = kv_layer[self._blocks(request.slot_mapping, kv_layer.device)].detach().cpu().contiguous()
                path = self._generate_filename_debug(layer_name, request.token_ids, request.mm_hashes)
                safetensors.torch.save_file({"kv_cache": kv}, path + ".tmp")
                os.replace(path + ".tmp", path)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs) -> None:
        for request in self._get_connector_metadata().requests:
            if request.is_store:
                continue
            for layer_name, layer in forward_context.no_compile_layers.items():
                kv_layer = getattr(layer, "kv_cache", None)
                if not isinstance(kv_layer, torch.Tensor) or kv_layer.dim() < 2:
                    continue
                path = self._generate_filename_debug(layer_name, request.token_ids, request.mm_hashes)
                src = safetensors.torch.load_file(path)["kv_cache"]
                kv_layer[self._blocks(request.slot_mapping, kv_layer.device)] = src.to(kv_layer.device)

    def _stored(self, token_ids: list[int], mm_hashes: list[str]) -> bool:
        folder = self._generate_foldername_debug(torch.tensor(token_ids), mm_hashes, create_folder=False)
        return os.path.isdir(folder) and any(name.endswith(".safetensors") for name in os.listdir(folder))

    # ----- scheduler side ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._kv_transfer_config.is_kv_producer:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) < 2 or not self._stored(prompt[:-1], [f.identifier for f in request.mm_features]):
            return 0, False
        logger.info("SlimWise: loading full-model KV for %d prompt tokens", len(prompt) - 1)
        return max(len(prompt) - 1 - num_computed_tokens, 0), False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ExampleConnectorMetadata:
        meta = ExampleConnectorMetadata()
        producer = self._kv_transfer_config.is_kv_producer
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = list(new_req.prompt_token_ids or [])
            mm_hashes = [f.identifier for f in new_req.mm_features]
            if new_req.req_id in self._requests_need_load:
                meta.requests.append(_meta(token_ids[:-1], new_req.block_ids[0], self._block_size, False, mm_hashes))
            elif producer and not self._stored(token_ids, mm_hashes):
                meta.requests.append(_meta(token_ids, new_req.block_ids[0], self._block_size, True, mm_hashes))
        self._requests_need_load.clear()
        return meta

    def _found_match_for_request(self, request: Request) -> bool:  # used by the base class's helpers
        prompt = list(request.prompt_token_ids or [])
        return self._stored(prompt[:-1], [f.identifier for f in request.mm_features])
