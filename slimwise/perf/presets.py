"""Synthetic model presets: real MoE configurations with random weights, for throughput work without
downloads.

Decode throughput depends on tensor shapes and routing, not on what the weights learned, so a random-weight
model with the real expert shapes and counts measures the same expert-weight traffic. Each preset keeps the
real expert shapes, counts, top-k, attention shapes and vocabulary; only the layer count is scaled down to fit
this machine (`layers`). `preset_config(name)` with layers=None is the full-size model for the roofline.

Sources (checked for this file):
- qwen3-30b-a3b: Qwen/Qwen3-30B-A3B config.json as mirrored by public configs (MindSpeed-RL
  configs/model/qwen3_30b_a3b.yaml; Qwen3-Coder-30B-A3B config.json, same backbone): 48 layers, hidden 2048,
  128 experts of intermediate 768, top-8, norm_topk_prob, 32 q / 4 kv heads of 128, vocab 151936,
  max_position_embeddings 40960, rope_theta 1e6, untied embeddings.
- qwen3.6-35b-a3b: transformers 5.19 `Qwen3_5MoeTextConfig` defaults (docstring: "Qwen3.5-35B-A3B style";
  Qwen3.6 shares the architecture), cross-checked against public copies of the Qwen3.5/3.6-35B-A3B
  config.json: 40 layers, full_attention_interval 4 (3 Gated-DeltaNet layers per full-attention layer),
  hidden 2048, 256 routed experts of 512 + 1 shared expert of 512, top-8, 16 q / 2 kv heads of 256 with an
  output gate, linear attention 16 key heads / 32 value heads of 128 and conv kernel 4, vocab 248320,
  partial rotary 0.25, rope_theta 1e7, mamba_ssm_dtype float32 (recurrent state in fp32), untied embeddings.
  The vision tower and the MTP head are not modelled: text decode without speculation runs neither.
- cpu: the random Qwen3-MoE measured in shared/notes/vllm.md (8 layers, hidden 1024, 64 experts of 512, top-4,
  bf16, ~1.6 GB): expert weights far exceed the CPU caches, so decode on 2 cores is weight-traffic bound.
- cpu-hybrid: Qwen3.6-35B-A3B's layout at half width for the CPU bench (text-only Qwen3_5MoeForCausalLM, 8
  layers: 6 Gated-DeltaNet + 2 gated full attention, hidden 1024, 64 experts of 512 top-8 + a gated shared
  expert of 512, fp32 recurrent state, linear heads of 64 as vLLM's CPU kernel needs): the state traffic per
  sequence is the same share of the expert pool as in the real model.
- smoke: a tiny Qwen3-MoE for tests of the build path (seconds).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from slimwise.errors import SlimWiseError
from slimwise.io import refuse_existing


@dataclass(frozen=True)
class Preset:
    """A named real configuration. `text` holds the (text) config fields at full size."""

    name: str
    model_type: str
    real_layers: int
    build_layers: int  # default layer count of build_synthetic on this machine (2 cores, ~20 GB RAM)
    source: str
    text: dict = field(default_factory=dict)
    layer_multiple: int = 1  # hybrid models: keep the linear/full attention mix exact
    bytes_note: str = ""


_QWEN3_30B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)

_QWEN36_35B = dict(
    vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts=256, num_experts_per_tok=8, max_position_embeddings=262144, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    attn_output_gate=True, mamba_ssm_dtype="float32", tie_word_embeddings=False,
)

_CPU = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
    head_dim=64, moe_intermediate_size=512, num_experts=64, num_experts_per_tok=4, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
)

# Qwen3.6-35B-A3B's design at half width for this CPU (a Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text):
# 3 Gated-DeltaNet layers per gated full-attention layer, routed experts top-8 + a gated shared expert of the
# same width, fp32 recurrent state (mamba_ssm_dtype, which vLLM adopts). Linear head dims are 64, not the real
# 128: vLLM's CPU Gated-DeltaNet kernel takes 64 (and rejects 32); sizes are multiples of 32 (CPU MoE kernel).
# Per sequence, the fp32 state read + written each step (6 layers x 16 heads x 64 x 64 x 4 B x 2 = 3.1 MB) is
# 0.19% of all expert weights (1.61 GB), as in the real model (129 MB of 64.4 GB = 0.20%).
_CPU_HYBRID = dict(
    vocab_size=4096, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
    linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=8,
    linear_num_value_heads=16, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts=64, num_experts_per_tok=8, max_position_embeddings=4096, rms_norm_eps=1e-6,
    attn_output_gate=True, mamba_ssm_dtype="float32", tie_word_embeddings=False,
)

# Qwen2-MoE's layout (Qwen1.5-MoE-A2.7B: a shared expert with its sigmoid gate beside the routed experts,
# softmax top-k without renormalization) at the `cpu` preset's width, with testbed-b's 32 experts and top-4
_CPU_SHARED = dict(
    vocab_size=4096, hidden_size=1024, intermediate_size=2048, num_attention_heads=16, num_key_value_heads=4,
    moe_intermediate_size=512, shared_expert_intermediate_size=1024, num_experts=32, num_experts_per_tok=4,
    norm_topk_prob=False, qkv_bias=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
)

_SMOKE = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
    head_dim=32, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=512, tie_word_embeddings=False,
)

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            "qwen3-30b-a3b",
            "qwen3_moe",
            48,
            2,
            "Qwen/Qwen3-30B-A3B config.json (public mirrors)",
            _QWEN3_30B,
            bytes_note="1.21 GB of experts per layer in bf16",
        ),
        Preset(
            "qwen3.6-35b-a3b",
            "qwen3_5_moe",
            40,
            4,
            "transformers 5.19 Qwen3_5MoeTextConfig defaults + public Qwen3.5/3.6-35B-A3B config.json",
            _QWEN36_35B,
            layer_multiple=4,
            bytes_note="1.61 GB of experts per layer in bf16",
        ),
        Preset(
            "cpu",
            "qwen3_moe",
            8,
            8,
            "shared/notes/vllm.md measured model",
            _CPU,
            bytes_note="about 1.6 GB in bf16",
        ),
        Preset(
            "cpu-hybrid",
            "qwen3_5_moe_text",
            8,
            8,
            "Qwen3.6-35B-A3B's layout (3:1 Gated-DeltaNet / full attention, top-8 + shared expert, fp32 "
            "state) at half width, 64 experts",
            _CPU_HYBRID,
            layer_multiple=4,
            bytes_note="about 1.8 GB in bf16",
        ),
        Preset(
            "cpu-shared",
            "qwen2_moe",
            8,
            8,
            "Qwen2-MoE's layout (shared expert + gate, top-k not renormalized) at the cpu preset's width, "
            "testbed-b's 32 experts top-4",
            _CPU_SHARED,
            bytes_note="about 0.9 GB in bf16",
        ),
        Preset("smoke", "qwen3_moe", 2, 2, "tiny test model", _SMOKE),
    )
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise SlimWiseError(f"unknown preset {name!r}; have: {', '.join(PRESETS)}")
    return PRESETS[name]


def _layer_count(preset: Preset, layers: int | None) -> int:
    n = preset.real_layers if layers is None else int(layers)
    if n < 1:
        raise SlimWiseError(f"preset {preset.name}: layers must be >= 1, got {n}")
    if n % preset.layer_multiple:
        raise SlimWiseError(
            f"preset {preset.name}: layers must be a multiple of {preset.layer_multiple} to keep "
            f"its linear/full attention mix, got {n}"
        )
    return n


def preset_config(name: str, layers: int | None = None, **overrides) -> PretrainedConfig:
    """The preset's transformers config; layers=None keeps the real layer count (what the roofline wants)."""
    preset = get_preset(name)
    n = _layer_count(preset, layers)
    text = dict(preset.text, num_hidden_layers=n, **overrides)
    if preset.model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        interval = preset.layer_multiple
        text.setdefault("layer_types", ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                        for i in range(n)])
        if preset.model_type == "qwen3_5_moe_text":  # text-only: saved as Qwen3_5MoeForCausalLM
            return AutoConfig.for_model(preset.model_type, **text)
        # the vision tower is never run by text decode; a minimal one keeps the config valid and small
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=1,
                      out_hidden_size=text["hidden_size"], num_position_embeddings=64)
        return AutoConfig.for_model("qwen3_5_moe", text_config=text, vision_config=vision,
                                    tie_word_embeddings=text.get("tie_word_embeddings", False))
    return AutoConfig.for_model(preset.model_type, **text)


# ----- routing skew ----------------------------------------------------------------------------------------

def selection_shares(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Share of top-k selections per expert for a batch of router logits [tokens, E] (sums to 1)."""
    idx = logits.topk(top_k, dim=-1).indices
    counts = torch.bincount(idx.flatten(), minlength=logits.shape[-1]).to(torch.float64)
    return counts / counts.sum()


def fit_row_scales(shares: torch.Tensor, top_k: int, samples: int = 4096, iters: int = 150,
                   seed: int = 0) -> torch.Tensor:
    """Per-expert scales a_j so that top-k over logits a_j * z_j (z iid N(0,1)) selects expert j at `shares`.

    Why scales: a random router on isotropic inputs gives iid Gaussian logits; a larger row norm widens that
    expert's logit distribution and puts it in the top-k more often (monotonically), a row norm near zero
    keeps it out. Qwen routers have no bias, and a bias-equivalent through a constant input direction would
    depend on what the hidden states carry, so row scaling is the change that holds for any isotropic input.
    Limit: a per-token selection probability k * share above about 1/2 is out of reach (a huge logit is
    still negative half the time); such shares are approached, not met. Fixed-point iteration on log a_j.
    """
    target = shares.to(torch.float64).clamp_min(0)
    if target.sum() <= 0:
        raise SlimWiseError("routing skew: the usage shares are all zero (no tokens counted)")
    target = target / target.sum()
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(samples, target.numel(), generator=g, dtype=torch.float64)
    log_a = torch.zeros(target.numel(), dtype=torch.float64)
    eps = 0.1 / (samples * top_k)
    for _ in range(iters):
        got = selection_shares(z * log_a.exp(), top_k)
        log_a = (log_a + 0.5 * ((target + eps).log() - (got + eps).log())).clamp(-8.0, 4.0)
    return (log_a - log_a.mean()).exp()  # only relative scales matter to top-k


def router_shares_on_random_inputs(weight: torch.Tensor, top_k: int, tokens: int = 8192,
                                   seed: int = 1) -> torch.Tensor:
    """Selection shares of a router weight [E, hidden] on iid N(0, I) inputs (the verification)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, weight.shape[1], generator=g, dtype=torch.float32)
    return selection_shares(x @ weight.float().T, top_k)


def apply_routing_skew(weight: torch.Tensor, shares: torch.Tensor, top_k: int, seed: int = 0) -> dict:
    """Rescale router rows in place so a random router follows `shares`; returns the check on fresh inputs."""
    scales = fit_row_scales(shares, top_k, seed=seed)
    with torch.no_grad():
        norms = weight.float().norm(dim=1, keepdim=True).clamp_min(1e-12)
        new = weight.float() / norms * norms.mean() * scales.to(torch.float32)[:, None]
        weight.copy_(new.to(weight.dtype))
    target = shares.to(torch.float64) / shares.sum()
    got = router_shares_on_random_inputs(weight, top_k, seed=seed + 1)
    return {"total_variation": float(0.5 * (got - target).abs().sum()),
            "max_abs_error": float((got - target).abs().max()),
            "target_max": float(target.max()), "achieved_max": float(got.max())}


def stats_rows(stats_path: str | Path, num_experts: int, n_layers: int) -> list[torch.Tensor]:
    """Usage shares for n_layers MoE layers, mapped proportionally over the stats' layers
    (depth-preserving)."""
    from slimwise.stats import ExpertStats

    stats = ExpertStats.load(stats_path)
    if stats.num_experts != num_experts:
        raise SlimWiseError(
            f"routing skew: {stats_path} has {stats.num_experts} experts per layer, the preset "
            f"has {num_experts}; calibrate a model with the same expert count"
        )
    shares = stats.usage_share()
    rows = len(stats.layers)
    return [shares[min(rows - 1, (i * rows) // n_layers)] for i in range(n_layers)]


# ----- tokenizer -------------------------------------------------------------------------------------------

SYNTH_SPECIALS = ("<|endoftext|>", "<|pad|>", "<|bos|>", "<|unk|>")


def write_synthetic_tokenizer(out_dir: str | Path, vocab_size: int) -> dict:
    """A WordLevel tokenizer with exactly `vocab_size` entries: 4 specials, then words "t4".."t{V-1}".

    Random-token benchmarks only need every id to be a token that round-trips through text: words are split
    on whitespace and decoded joined by single spaces, so decode(encode(text)) is exact for such text.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocab = {t: i for i, t in enumerate(SYNTH_SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SYNTH_SPECIALS), vocab_size)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with one space
    tok.add_special_tokens(list(SYNTH_SPECIALS))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"eos_token": SYNTH_SPECIALS[0], "pad_token": SYNTH_SPECIALS[1], "bos_token": SYNTH_SPECIALS[2],
               "unk_token": SYNTH_SPECIALS[3]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 1 << 20}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 2}


# ----- build -----------------------------------------------------------------------------------------------

def build_synthetic(name: str, out_dir: str | Path, layers: int | None = None, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16, routing_skew_from: str | Path | None = None,
                    force: bool = False, top_k: int | None = None) -> Path:
    """Write a random-weight checkpoint of preset `name` (scaled to `layers`) plus a tokenizer and a manifest.

    top_k (default: the preset's) sets the routed experts per token, so that a trained model's plan (which
    names its top-k) runs on the preset's sizes.

    layers=None takes the preset's build default (sized for this machine, not the real count). With
    routing_skew_from (a `slimwise calibrate` stats file) the routers are rescaled so that random inputs
    select experts at the measured per-layer usage shares; the achieved fit is in slimwise_synthetic.json.
    """
    from transformers import AutoModelForCausalLM

    from slimwise.adapters import get_adapter

    preset = get_preset(name)
    n = _layer_count(preset, preset.build_layers if layers is None else layers)
    out = Path(out_dir)
    refuse_existing(out, force)
    config = preset_config(name, layers=n, **({} if top_k is None else {"num_experts_per_tok": top_k}))
    text = getattr(config, "text_config", config)
    adapter = get_adapter(config)
    if adapter.top_k(config) > adapter.num_experts(config):
        raise SlimWiseError(f"--top-k {top_k}: preset {name} has {adapter.num_experts(config)} experts "
                            "per layer")
    ids = {"eos_token_id": 0, "pad_token_id": 1, "bos_token_id": 2}
    for key, value in ids.items():
        setattr(text, key, value)
    # reject a bad stats file before spending minutes on random init
    skew_rows = None
    if routing_skew_from is not None:
        # every layer of these presets is sparse: one shares row per layer
        skew_rows = stats_rows(routing_skew_from, adapter.num_experts(config), n)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    manifest: dict = {"preset": name, "layers": n, "real_layers": preset.real_layers, "seed": seed,
                      "dtype": str(dtype).removeprefix("torch."), "source": preset.source,
                      "routing_skew_from": str(routing_skew_from) if routing_skew_from else None,
                      "top_k": top_k}
    if skew_rows is not None:
        moe = adapter.moe_layers(model)
        if len(moe) != len(skew_rows):
            skew_rows = [skew_rows[min(len(skew_rows) - 1, i)] for i in range(len(moe))]
        fits = [
            apply_routing_skew(
                layer.router.weight.data, shares, adapter.top_k(config), seed=seed + layer.index
            )
            for layer, shares in zip(moe, skew_rows, strict=True)
        ]
        manifest["routing_fit"] = {
            "method": "router rows rescaled (fit_row_scales); checked on fresh N(0, I) inputs",
            "max_total_variation": max(f["total_variation"] for f in fits),
            "mean_total_variation": sum(f["total_variation"] for f in fits) / len(fits),
            "per_layer": fits,
        }
        worst = manifest["routing_fit"]["max_total_variation"]
        if worst > 0.1:
            warnings.warn(f"routing skew only partly reproduced (total variation {worst:.2f}): shares above "
                          f"~1/(2*top_k) per expert are out of reach of row scaling", stacklevel=2)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    write_synthetic_tokenizer(out, text.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    manifest["parameters"] = params
    manifest["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    manifest["gb"] = round(manifest["bytes"] / 1e9, 3)
    (out / "slimwise_synthetic.json").write_text(json.dumps(manifest, indent=2) + "\n")
    del model
    return out


def preset_table() -> list[dict]:
    """One row per preset with its shapes and full-size parameter count (meta device, no memory)."""
    from slimwise.perf.roofline import RooflineConfig

    rows = []
    for p in PRESETS.values():
        rc = RooflineConfig.from_hf(preset_config(p.name), name=p.name)
        rows.append(
            {
                "preset": p.name,
                "model_type": p.model_type,
                "layers": p.real_layers,
                "experts": rc.num_experts,
                "top_k": rc.top_k,
                "params_b": round(rc.total_params / 1e9, 3),
                "bf16_gb": round(rc.total_params * 2 / 1e9, 2),
                "source": p.source,
            }
        )
    return rows


__all__ = ["PRESETS", "Preset", "apply_routing_skew", "build_synthetic", "fit_row_scales", "get_preset",
           "preset_config", "preset_table", "router_shares_on_random_inputs", "write_synthetic_tokenizer"]
