"""Tiny quantized checkpoints built from a bf16 checkpoint's files, the way the formats' own tools lay them
out (nothing is downloaded): block-wise FP8 (`quant_method: fp8`, DeepSeek-V3 / Qwen3 FP8 releases) and
compressed-tensors (llm-compressor's format; W8A8 int8 and W4A16 packed int4), the values computed with
compressed-tensors' own quantize / pack functions.

Which tensors are quantized: the 2-D weights of linear layers (attention projections, experts, shared
experts); embeddings, norms, routers and the LM head stay as stored, and are named in the config's
`modules_to_not_convert` / `ignore` the way the official releases name them (one literal module name per
layer).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# linear weights a quantizer converts (routers `mlp.gate`, `shared_expert_gate` stay, as releases keep them)
_LINEAR = re.compile(r"\.(self_attn\.[qkvo]_proj|(experts\.\d+|shared_experts?)\.(gate|up|down)_proj)"
                     r"\.weight$")
_KEPT_MODULE = re.compile(r"^(?P<m>.*\.mlp\.(gate|shared_expert_gate))\.weight$")


def _copy_side_files(src: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name != "config.json":
            shutil.copy2(path, out / path.name)
    return json.loads((src / "config.json").read_text())


def _not_converted(tensors: dict) -> list[str]:
    return ["lm_head", *sorted(m["m"] for name in tensors if (m := _KEPT_MODULE.match(name)))]


def fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` as e4m3 values and one float32 `weight_scale_inv` per block (value = fp8 * scale_inv); blocks
    at the edges may be partial."""
    rows, cols = weight.shape
    b0, b1 = block
    w = weight.float()
    scale = torch.empty(-(-rows // b0), -(-cols // b1))
    q = torch.empty_like(w)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            s = tile.abs().amax().clamp(min=1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = tile / s
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_checkpoint(src: str | Path, out: str | Path, block: tuple[int, int] = (32, 32)) -> Path:
    """The checkpoint in `src` with its linear weights in block-wise FP8 (`weight_block_size: block`)."""
    src, out = Path(src), Path(out)
    config = _copy_side_files(src, out)
    tensors = load_file(src / "model.safetensors")
    quantized = {}
    for name, tensor in tensors.items():
        if _LINEAR.search(name) and tensor.dim() == 2:
            quantized[name], quantized[name[: -len("weight")] + "weight_scale_inv"] = fp8_block(tensor, block)
        else:
            quantized[name] = tensor
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "modules_to_not_convert": _not_converted(tensors),
    }
    save_file(quantized, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def compressed_checkpoint(src: str | Path, out: str | Path, scheme: str = "W4A16",
                          group_size: int = 32) -> Path:
    """The checkpoint in `src` compressed as llm-compressor writes `scheme` (W8A8: int8 per-channel weights,
    dynamic per-token int8 activations, `int-quantized`; W4A16: int4 symmetric groups of `group_size`,
    `pack-quantized`), scales from each weight's min/max (compressed-tensors' `calculate_qparams`)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.config import CompressionFormat
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, QuantizationStatus
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    src, out = Path(src), Path(out)
    config = _copy_side_files(src, out)
    tensors = load_file(src / "model.safetensors")
    scheme_obj: QuantizationScheme = preset_name_to_scheme(scheme, ["Linear"])
    if scheme == "W4A16":
        scheme_obj.weights.group_size = group_size
        fmt = CompressionFormat.pack_quantized
    else:
        fmt = CompressionFormat.int_quantized
    compressor = BaseCompressor.load_from_registry(fmt.value)
    args = scheme_obj.weights
    written = {}
    for name, tensor in tensors.items():
        if not (_LINEAR.search(name) and tensor.dim() == 2):
            written[name] = tensor
            continue
        w = tensor.float()
        view = w.view(w.shape[0], -1, args.group_size) if args.group_size else w.view(w.shape[0], 1, -1)
        lo, hi = view.amin(dim=-1), view.amax(dim=-1)
        scale, zero = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale.to(tensor.dtype), "weight_zero_point": zero}
        module = name[: -len("weight")]
        for key, value in compressor.compress(state, scheme_obj).items():
            written[module + key] = value.contiguous()
    qconfig = QuantizationConfig(config_groups={"group_0": scheme_obj}, format=fmt.value,
                                 quantization_status=QuantizationStatus.COMPRESSED,
                                 ignore=_not_converted(tensors))
    config["quantization_config"] = (qconfig.model_dump(exclude_none=True)
                                     | {"quant_method": "compressed-tensors"})
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    return out
