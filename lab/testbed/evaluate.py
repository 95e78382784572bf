"""Evaluate a testbed model on the task suite and write its model card.

`evaluate_model` loads a checkpoint with stock transformers, generates greedily with the reference engine
(`PhaseSplitEngine`, mode "full"), grades every answer with `grade`, and measures the routing load: per MoE
layer, the busiest expert's share of the routed (token, slot) assignments divided by the uniform share 1/E,
from one teacher-forced pass over the split's prompt + worked solution + EOS (all tokens, and the solution
tokens alone, i.e. what decode sees).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import shlex
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from string import Template

import torch
import torch.nn.functional as F

from lab.testbed.backbones import (
    CARD_NAMES,
    copy_model_files,
    count_parameters,
    moe_blocks,
)
from lab.testbed.tokenizer import encode_sample
from lab.testbed.train_config import ALWAYS_SPELLED, TRAIN_OPTIONS, TrainConfig
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.io import atomic_dir, atomic_write_text
from slimwise.models import load_tokenizer
from slimwise.options import argv_of, command_of
from slimwise.testbed.long_tasks import LENGTHS, LONG_DOMAIN, LONG_FAMILIES, make_long_split
from slimwise.testbed.tasks import DOMAINS, FAMILIES, Sample, grade, make_split

#: The routing-load bound of a shipped testbed: in every MoE layer, the busiest expert's share of the routed
#: assignments is at most this multiple of the uniform share 1/E (the card reports it, the shipped-model tests
#: check it).
ROUTING_LIMIT = 3.0


#: Where uniform pruning at 50% must land on a testbed (`pruning_regime`): it costs accuracy or changes the
#: length measurably, so pruning matters, yet the pruned model still solves problems, so methods can be told
#: apart.
BAND = {"min_cost_points": 10.0, "min_length_change_pct": 15.0, "min_kept_accuracy": 0.30}


def pruning_regime(report: dict, source: str, command: str) -> dict:
    """Where a backbone lands under uniform pruning, from a `slimwise eval` report (target domain).

    Per calibration phase: the best criterion at 50% (highest uniform accuracy), its uniform and SlimWise
    accuracy and mean length at every ratio, and whether 50% falls in the band: uniform costs at least 10
    points or changes the mean length by at least 15%, yet keeps at least 30% accuracy.
    """
    full = report["full"]
    out: dict = {"source": source, "command": command, "full": {"accuracy": full["accuracy"],
                                                                  "length_mean": full["length_mean"]},
                 "n": len(full["correct"]), "phases": {}}
    runs = report["runs"]
    out["criteria"] = sorted({r["criterion"] for r in runs})
    for phase in sorted({r["phase"] for r in runs}):
        at50 = [r for r in runs if r["phase"] == phase and r["mode"] == "uniform"
                and abs(r["ratio"] - 0.5) < 1e-9]
        if not at50:
            continue
        best = max(at50, key=lambda r: r["metrics"]["accuracy"])["criterion"]
        rows = []
        for r in sorted((r for r in runs if r["phase"] == phase and r["criterion"] == best),
                        key=lambda r: r["ratio"]):
            if r["mode"] in ("uniform", "slimwise"):
                rows.append({"ratio": r["ratio"], "mode": r["mode"], "accuracy": r["metrics"]["accuracy"],
                             "length_mean": r["metrics"]["length_mean"]})
        u50 = next(x for x in rows if x["mode"] == "uniform" and abs(x["ratio"] - 0.5) < 1e-9)
        cost = 100 * (full["accuracy"] - u50["accuracy"])
        change = 100 * (u50["length_mean"] / full["length_mean"] - 1)
        in_band = ((cost >= BAND["min_cost_points"] or abs(change) >= BAND["min_length_change_pct"])
                   and u50["accuracy"] >= BAND["min_kept_accuracy"])
        out["phases"][phase] = {"best_criterion": best, "rows": rows, "uniform50_cost_points": cost,
                                "uniform50_length_change_pct": change, "in_band": in_band}
    return out


def load_trained(model_dir: str | os.PathLike, dtype: str | torch.dtype = "auto",
               experts_implementation: str | None = None):
    """Stock transformers load (the shipped dtype by default) plus the tokenizer saved next to it."""
    from transformers import AutoModelForCausalLM

    kwargs = {"experts_implementation": experts_implementation} if experts_implementation else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True, **kwargs)
    return model.eval(), load_tokenizer(model_dir)


@torch.inference_mode()
def routing_load(model, tokenizer, samples: list[Sample], batch_size: int = 32) -> dict:
    """Teacher-forced pass over prompt + target: per-layer expert counts,
    max share / uniform, target-token CE."""
    blocks = moe_blocks(model)
    num_experts = model.config.num_experts
    counts_all = torch.zeros(len(blocks), num_experts, dtype=torch.long)
    counts_target = torch.zeros(len(blocks), num_experts, dtype=torch.long)
    captured: list[torch.Tensor] = []
    handles = [b.gate.register_forward_hook(lambda m, a, o: captured.append(o[2])) for b in blocks]
    ce_sum, ce_n = 0.0, 0
    try:
        for start in range(0, len(samples), batch_size):
            enc = [encode_sample(tokenizer, s) for s in samples[start:start + batch_size]]
            width = max(len(p) + len(t) for p, t in enc)
            ids = torch.full((len(enc), width), tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(enc), width), dtype=torch.long)
            target = torch.zeros((len(enc), width), dtype=torch.bool)
            for i, (p, t) in enumerate(enc):
                ids[i, :len(p) + len(t)] = torch.tensor(p + t)
                mask[i, :len(p) + len(t)] = 1
                target[i, len(p):len(p) + len(t)] = True
            captured.clear()
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
            # CE of the target tokens: position t predicts token t + 1
            pred, gold, sel = logits[:, :-1], ids[:, 1:], target[:, 1:]
            ce = F.cross_entropy(pred[sel], gold[sel], reduction="sum")
            ce_sum, ce_n = ce_sum + float(ce), ce_n + int(sel.sum())
            valid, tmask = mask.reshape(-1).bool(), target.reshape(-1)
            for layer, idx in enumerate(captured):
                counts_all[layer] += torch.bincount(idx[valid].reshape(-1), minlength=num_experts)
                counts_target[layer] += torch.bincount(idx[tmask].reshape(-1), minlength=num_experts)
    finally:
        for h in handles:
            h.remove()

    def ratio(c: torch.Tensor) -> list[float]:
        return [round(float(row.max()) * num_experts / max(1, float(row.sum())), 3) for row in c]

    return {
        "num_experts": num_experts,
        "top_k": model.config.num_experts_per_tok,
        "tokens": int(counts_all[0].sum()) // model.config.num_experts_per_tok,
        "max_share_over_uniform": ratio(counts_all),
        "max_share_over_uniform_target_tokens": ratio(counts_target),
        "unused_experts_per_layer": [int((row == 0).sum()) for row in counts_all],
        "limit": ROUTING_LIMIT,
        "within_limit": all(r <= ROUTING_LIMIT for r in ratio(counts_all)),
        "target_loss": ce_sum / max(1, ce_n),
    }


def evaluate_model(model_dir: str | os.PathLike | None = None, split: str = "test", n_per_family: int = 50,
                   domain: str | None = None, *, seed: int = 0, batch_size: int = 32,
                   max_new_tokens: int | None = None, model=None, tokenizer=None,
                   dtype: str | torch.dtype = "auto", routing: bool = True, families: list[str] | None = None,
                   progress: bool = False, examples: int = 2, samples: list[Sample] | None = None) -> dict:
    """Greedy accuracy per family and per domain on a split, mean generated length, EOS share, routing load.

    Pass a model directory (loaded with stock transformers) or an already loaded `model` + `tokenizer`.
    `max_new_tokens` defaults to 1.5x the longest target (EOS included) of the evaluated samples. `samples`
    replaces the make_split draw (the long-prompt families: `evaluate_long`).
    """
    if model is None:
        model, tokenizer = load_trained(model_dir, dtype=dtype)
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir)
    if samples is None:
        samples = make_split(split, n_per_family, seed=seed, families=families, domain=domain)
    longest = max(len(encode_sample(tokenizer, s)[1]) for s in samples)
    max_new = max_new_tokens or math.ceil(1.5 * longest)
    t0 = time.perf_counter()
    engine = PhaseSplitEngine(model, tokenizer)
    gens = engine.generate([s.prompt for s in samples], mode="full",
                           config=GenerationConfig(max_new_tokens=max_new,
                                                   batch_size=batch_size, progress=progress))
    gen_seconds = time.perf_counter() - t0

    per: dict[str, dict] = defaultdict(lambda: {"n": 0, "correct": 0, "tokens": 0, "eos": 0, "stopped": 0,
                                                "failures": []})
    for s, g in zip(samples, gens, strict=True):
        gr = grade(s, g.text or "", stopped_by_eos=g.finish_reason == "eos")
        r = per[s.family]
        r["domain"] = s.domain
        r["n"] += 1
        r["correct"] += int(gr.correct)
        r["tokens"] += len(g.token_ids)
        r["eos"] += int(g.finish_reason == "eos")
        r["stopped"] += int(gr.stopped)
        if not gr.correct and len(r["failures"]) < examples:
            r["failures"].append({"prompt": s.prompt, "answer": s.answer, "output": g.text})

    fam_out = {}
    for name in (f for f in [*FAMILIES, *LONG_FAMILIES] if f in per):
        r = per[name]
        fam_out[name] = {"domain": r["domain"], "n": r["n"], "accuracy": r["correct"] / r["n"],
                         "mean_tokens": r["tokens"] / r["n"], "eos_share": r["eos"] / r["n"],
                         "stopped_share": r["stopped"] / r["n"], "failures": r["failures"]}
    dom_out = {}
    for d in (*DOMAINS, LONG_DOMAIN):
        rows = [per[f] for f in fam_out if fam_out[f]["domain"] == d]
        if rows:
            n = sum(r["n"] for r in rows)
            dom_out[d] = {"n": n, "accuracy": sum(r["correct"] for r in rows) / n,
                          "families": [f for f in fam_out if fam_out[f]["domain"] == d]}
    n = len(samples)
    result = {
        "split": split, "n_per_family": n_per_family, "seed": seed, "n": n, "max_new_tokens": max_new,
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "accuracy": sum(r["correct"] for r in per.values()) / n,
        "mean_tokens": sum(r["tokens"] for r in per.values()) / n,
        "eos_share": sum(r["eos"] for r in per.values()) / n,
        "families": fam_out, "domains": dom_out, "generation_seconds": gen_seconds,
    }
    if routing:
        result["routing"] = routing_load(model, tokenizer, samples, batch_size)
    return result


def evaluate_long(model, tokenizer, n_per_family: int, lengths: Sequence[int] = LENGTHS, *, seed: int = 0,
                  split: str = "test", batch_size: int = 16) -> dict:
    """Greedy accuracy of the long-prompt families at each prompt length (`long_tasks.make_long_split`), with
    the prompts' mean length in tokens. The model must hold the longest prompt plus its answer
    (max_position_embeddings)."""
    out: dict = {"split": split, "n_per_family": n_per_family, "seed": seed, "lengths": {}}
    for length in lengths:
        samples = make_long_split(split, n_per_family, length, seed=seed)
        r = evaluate_model(samples=samples, model=model, tokenizer=tokenizer, batch_size=batch_size,
                           routing=False, examples=1)
        prompt_tokens = [len(encode_sample(tokenizer, s)[0]) for s in samples]
        out["lengths"][str(length)] = {
            "accuracy": r["accuracy"], "mean_tokens": r["mean_tokens"],
            "mean_prompt_tokens": sum(prompt_tokens) / len(prompt_tokens),
            "max_prompt_tokens": max(prompt_tokens),
            "families": {f: {k: v for k, v in row.items() if k != "domain"}
                         for f, row in r["families"].items()},
        }
    return out


def trains_long(train_config: dict) -> bool:
    """Whether a run's stream held the long-prompt families (their weights default to 0)."""
    return any((train_config.get("family_weights") or {}).get(f, 0) > 0 for f in LONG_FAMILIES)


# --------------------------------------------------------------------------------------------------------
# Model card: card.md.tmpl holds the text, `card_fields` the figures and the choice of optional parts.

CARD_TEMPLATE = Path(__file__).with_name("card.md.tmpl")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _size_mb(path: Path) -> float:
    return path.stat().st_size / 1e6 if path.is_file() else float("nan")


@functools.cache
def _card_parts() -> dict[str, Template]:
    """The named parts of card.md.tmpl (its opening note describes the format)."""
    text = CARD_TEMPLATE.read_text().replace("\\\n", "")
    _note, *parts = re.split(r"^@@ (\w+)$", text, flags=re.M)
    return {name: Template(body.strip("\n")) for name, body in zip(parts[::2], parts[1::2], strict=True)}


def _part(name: str, **fields) -> str:
    return _card_parts()[name].substitute(fields)


def _paragraph(name: str, **fields) -> str:
    """An optional paragraph or section: it brings the blank line that separates it from the text before."""
    return "\n\n" + _part(name, **fields)


def _is_hybrid(cfg: dict) -> bool:
    return "linear_attention" in (cfg.get("layer_types") or [])


def _architecture_rows(out: Path, cfg: dict, params: dict) -> str:
    shared = cfg.get("shared_expert_intermediate_size")
    layer_types = cfg.get("layer_types") or []
    hybrid = _is_hybrid(cfg)
    rope = cfg.get("rope_parameters") or {}
    rows = [
        ("architecture", cfg["architectures"][0]), ("model_type", cfg["model_type"]),
        ("layers", cfg["num_hidden_layers"]), ("hidden size", cfg["hidden_size"]),
    ]
    if hybrid:
        n_lin = layer_types.count("linear_attention")
        rows += [
            ("layer types",
             f"{', '.join('linear' if t == 'linear_attention' else 'full' for t in layer_types)} "
             f"({n_lin} Gated-DeltaNet : {len(layer_types) - n_lin} full attention)"),
            ("Gated-DeltaNet key / value heads, head dim",
             f"{cfg['linear_num_key_heads']} / {cfg['linear_num_value_heads']}, {cfg['linear_key_head_dim']} "
             f"/ {cfg['linear_value_head_dim']}; causal conv kernel {cfg['linear_conv_kernel_dim']}"),
        ]
    rows += [
        ("attention heads / KV heads" + (" (full attention, output-gated)" if hybrid else ""),
         f"{cfg['num_attention_heads']} / {cfg['num_key_value_heads']}"),
        ("head dim", cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
    ]
    if rope.get("partial_rotary_factor") not in (None, 1.0):
        rows.append(("partial rotary factor", rope["partial_rotary_factor"]))
    rows += [
        ("routed experts / top-k", f"{cfg['num_experts']} / {cfg['num_experts_per_tok']}"),
        ("expert intermediate size", cfg["moe_intermediate_size"]),
        # Qwen3.5/3.6-MoE's router always renormalises its top-k weights (no config field)
        ("norm_topk_prob", cfg.get("norm_topk_prob", True if hybrid else None)),
        ("shared expert", f"intermediate {shared}, sigmoid gate" if shared else "none"),
        ("vocab size", cfg["vocab_size"]), ("max positions", cfg["max_position_embeddings"]),
        ("parameters (total / routed experts / active per token)",
         f"{params['total'] / 1e6:.2f}M / {params['routed_experts'] / 1e6:.2f}M / "
         f"{params['active'] / 1e6:.2f}M"),
        ("weights", f"bfloat16 safetensors, {_size_mb(out / 'model.safetensors'):.1f} MB"),
    ]
    return "\n".join(f"| {k} | {v} |" for k, v in rows)


def _batches(tc: dict, summary: dict, hybrid: bool) -> str:
    """How training batched the samples: packed rows (the default) or one padded sample per row."""
    if summary.get("packing", "packed") == "packed":
        return _part("batches_packed", seq_len=tc["seq_len"],
                     packed_linear_attention=_part("packed_linear_attention") if hybrid else "")
    real = (_part("real_tokens", share=f"{summary['tokens'] / max(1, summary.get('positions', 0)):.0%}")
            if summary.get("positions") else "")
    return _part("batches_padded", row_groups=tc.get("row_groups", 3), real_tokens=real)


def _training_fields(tc: dict, summary: dict, test: dict, hybrid: bool) -> dict:
    fl, nan = summary.get("final_loss", {}), float("nan")
    long_max = tc.get("long_max_length", 1024)
    kernel = ""
    if hybrid:
        kernel = _part("linear_attention_kernel",
                       segment_aware=_part("segment_aware") if summary.get("packing") == "packed" else "")
    return {
        "seed": tc["seed"],
        "budget": (f"wall-clock budget {tc['minutes']} min" if tc.get("minutes")
                   else f"{tc.get('max_steps')} steps"),
        "processes": (f"{tc['ranks']} data-parallel processes of 1 torch thread" if tc.get("ranks", 1) > 1
                      else f"torch threads: {'auto 1/2' if tc['threads'] <= 0 else tc['threads']}"),
        "steps": summary["steps"], "tokens": f"{summary['tokens']:,}",
        "wall_minutes": f"{summary['wall_seconds'] / 60:.1f}",
        "tokens_per_second": f"{summary['tokens_per_second']:.0f}",
        "final_ce": f"{fl.get('ce', nan):.4f}", "final_aux": f"{fl.get('aux', nan):.4f}",
        "final_loss": f"{fl.get('loss', nan):.4f}",
        # an empty line where the test split was evaluated without the routing pass
        "target_loss": (_part("target_loss", dtype=test["dtype"],
                              loss=f"{test['routing']['target_loss']:.4f}") if "routing" in test else ""),
        "samples_per_family": tc["samples_per_family"],
        "weights": f", weights {tc['family_weights']}" if tc["family_weights"] else "",
        "batches": _batches(tc, summary, hybrid),
        "prompt_weight": f", prompt weight {tc['prompt_loss_weight']}" if tc["prompt_loss_weight"] else "",
        "aux_loss_coef": tc["aux_loss_coef"],
        # the space before the next words is added here: editors strip a space that ends a template line
        "muon": _part("muon") + " " if tc.get("optimizer", "adamw") == "muon" else "",
        "lr": tc["lr"], "betas": tuple(tc["betas"]), "weight_decay": tc["weight_decay"],
        "grad_clip": tc["grad_clip"], "warmup_steps": tc["warmup_steps"], "min_lr_ratio": tc["min_lr_ratio"],
        "init": (_part("init_from", source=shown_runs([tc.get("out") or "", tc["init_from"]])[1],
                       overrides=tc.get("model_overrides") or "none")
                 if tc.get("init_from") else
                 _part("init_default", pair_init=_part("pair_init")
                       if tc.get("pair_init") and tc.get("spaced_pairs", True) else "")),
        "long_data": (_part("long_data", max_length=f"{long_max:,}",
                            top=_part("long_top", share=f"{tc['long_top_share']:.0%}",
                                      half=f"{long_max // 2:,}", max_length=f"{long_max:,}")
                            if tc.get("long_top_share") else "")
                      if trains_long(tc) else ""),
        "linear_attention_kernel": kernel,
    }


def _family_table(test: dict, heldout: dict | None) -> str:
    head = "| family | domain | test acc | test mean tokens | test EOS share |"
    sep = "| --- | --- | --- | --- | --- |"
    if heldout:
        head += " held-out acc | held-out mean tokens | held-out EOS share |"
        sep += " --- | --- | --- |"
    rows = [head, sep]
    for fam, r in test["families"].items():
        row = (f"| {fam} | {r['domain']} | {_pct(r['accuracy'])} | {r['mean_tokens']:.1f} | "
               f"{_pct(r['eos_share'])} |")
        if heldout:
            h = heldout["families"][fam]
            row += f" {_pct(h['accuracy'])} | {h['mean_tokens']:.1f} | {_pct(h['eos_share'])} |"
        rows.append(row)
    return "\n".join(rows)


def _domain_rows(test: dict, heldout: dict | None) -> str:
    rows = []
    for d, r in test["domains"].items():
        hv = _pct(heldout["domains"][d]["accuracy"]) if heldout else "-"
        rows.append(f"| {d} | {_pct(r['accuracy'])} | {hv} |")
    rows.append(f"| all | {_pct(test['accuracy'])} | {_pct(heldout['accuracy']) if heldout else '-'} |")
    return "\n".join(rows)


def _evaluation_fields(test: dict, heldout: dict | None) -> dict:
    """The evaluation text, tables and quality bars: target domain >= 85%, every family >= 60%."""
    arith = test["domains"].get("arithmetic", {}).get("accuracy", 0.0)
    accuracies = [(f, r["accuracy"]) for f, r in test["families"].items()]
    weakest, weakest_acc = min(accuracies, key=lambda fa: fa[1])
    below = arith < 0.85 or weakest_acc < 0.6
    return {
        "dtype": test["dtype"],
        "upcast": " " + _part("upcast") if test["dtype"] == "float32" else "",  # the space: as for "muon"
        "n_per_family": test["n_per_family"],
        "heldout_split": _part("heldout_split", n=heldout["n_per_family"]) if heldout else "",
        "family_table": _family_table(test, heldout), "domain_rows": _domain_rows(test, heldout),
        "arithmetic": _pct(arith), "arithmetic_met": "met" if arith >= 0.85 else "NOT met",
        "weakest": weakest, "weakest_accuracy": _pct(weakest_acc),
        "weakest_met": "met" if weakest_acc >= 0.6 else "NOT met",
        "below_bars": _paragraph("below_bars") if below else "",
        "mean_tokens": f"{test['mean_tokens']:.1f}", "eos_share": _pct(test["eos_share"]),
        "heldout_length": (f"; held-out: {heldout['mean_tokens']:.1f} tokens, "
                           f"EOS share {_pct(heldout['eos_share'])}" if heldout else ""),
    }


#: The long-prompt bar: the full model's accuracy at the longest swept length, over the long families.
LONG_BAR = 0.80


def _long_section(long: dict | None) -> str:
    """Accuracy per long family and prompt length, and the long-prompt bar at the longest length."""
    if not long:
        return ""
    lengths = long["lengths"]
    families = list(next(iter(lengths.values()))["families"])
    rows = [f"| prompt length (characters) | mean prompt tokens | {' | '.join(families)} | all |",
            "| --- | --- |" + " --- |" * (len(families) + 1)]
    for length, r in lengths.items():
        cells = " | ".join(_pct(r["families"][f]["accuracy"]) for f in families)
        rows.append(f"| {int(length):,} | {r['mean_prompt_tokens']:,.0f} | {cells} | {_pct(r['accuracy'])} |")
    longest = max(lengths, key=int)
    top = lengths[longest]
    return _paragraph("long_section", n=long["n_per_family"], table="\n".join(rows),
                      longest=f"{int(longest):,}", tokens=f"{top['mean_prompt_tokens']:,.0f}",
                      accuracy=_pct(top["accuracy"]),
                      met="met" if top["accuracy"] >= LONG_BAR else "NOT met",
                      long_below_bar=_part("long_below_bar") if top["accuracy"] < LONG_BAR else "")


def _limitations(cfg: dict, test: dict, heldout: dict | None) -> str:
    items = []
    weak = [f for f, r in test["families"].items() if r["accuracy"] < 0.6]
    if weak:
        families = ", ".join(f"{f} ({_pct(test['families'][f]['accuracy'])})" for f in weak)
        items.append(_part("limitation_weak", families=families))
    if heldout:
        items.append(_part("limitation_heldout", accuracy=_pct(heldout["accuracy"])))
    items.append(_part("limitation_size", layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"]))
    return "\n".join(items)


_COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _pruning_section(pruning: dict | None) -> str:
    """Uniform vs SlimWise accuracy and length per calibration phase and ratio, then each phase's verdict."""
    if not pruning:
        return ""
    rows = []
    for phase, ph in pruning["phases"].items():
        by_ratio: dict = {}
        for row in ph["rows"]:
            by_ratio.setdefault(row["ratio"], {})[row["mode"]] = row
        for ratio, m in sorted(by_ratio.items()):
            u, w = m.get("uniform"), m.get("slimwise")
            rows.append(f"| {phase} | {ph['best_criterion']} | {ratio:g} | "
                        + (f"{_pct(u['accuracy'])} | {u['length_mean']:.1f}" if u else "- | -") + " | "
                        + (f"{_pct(w['accuracy'])} | {w['length_mean']:.1f}" if w else "- | -") + " |")
    rows.append("")
    for phase, ph in pruning["phases"].items():
        rows.append(_part("pruning_phase", phase=phase, cost=f"{ph['uniform50_cost_points']:.1f}",
                          change=f"{ph['uniform50_length_change_pct']:+.1f}",
                          verdict=_part("in_band" if ph["in_band"] else "not_in_band")))
    full = pruning["full"]
    count = len(pruning["criteria"])
    return _paragraph("pruning", criteria=_COUNT_WORDS.get(count, str(count)), n=pruning["n"],
                      full_accuracy=_pct(full["accuracy"]),
                      full_length=f"{full['length_mean']:.1f}", source=pruning["source"],
                      command=pruning["command"], rows="\n".join(rows))


def _routing_section(test: dict) -> str:
    if "routing" not in test:
        return ""
    rt = test["routing"]
    per_layer = zip(rt["max_share_over_uniform"], rt["max_share_over_uniform_target_tokens"],
                    rt["unused_experts_per_layer"], strict=True)
    rows = [f"| {i} | {a:.2f}x | {t:.2f}x | {u} |" for i, (a, t, u) in enumerate(per_layer)]
    return _paragraph("routing", experts=rt["num_experts"], tokens=f"{rt['tokens']:,}", limit=rt["limit"],
                      rows="\n".join(rows))


def card_fields(out: Path, name: str, train_config: dict, summary: dict, test: dict, heldout: dict | None,
                command: str, pruning: dict | None = None, long: dict | None = None,
                stages: list[dict] | None = None) -> dict:
    """Every field of the card template's `card` part, optional parts already rendered (or empty)."""
    from slimwise.embedded import EMBEDDED

    cfg = json.loads((out / "config.json").read_text())
    model, _ = load_trained(out)
    hybrid = _is_hybrid(cfg)
    tc = train_config
    loading = _part("loading_hybrid" if hybrid else "loading_stock", vocab_size=cfg["vocab_size"])
    return {
        "name": name, "architecture": cfg["architectures"][0],
        "architecture_rows": _architecture_rows(out, cfg, count_parameters(model)),
        "loading": loading,
        "one_token_names": _part("one_token_names") if tc.get("spaced_pairs", True) is False else "",
        "command": command, "earlier_stages": _stages_part(stages or [], summary),
        **_training_fields(tc, summary, test, hybrid),
        **_evaluation_fields(test, heldout),
        "long_intro": (" " + _part("long_intro", source=_root_source(tc, stages or []),
                                   layer_change=_layer_change(tc),
                                   max_length=f"{tc.get('long_max_length', 1024):,}")
                       if trains_long(tc) else ""),
        "long_section": _long_section(long),
        "limitations": _limitations(cfg, test, heldout),
        "pruning": _pruning_section(pruning), "routing": _routing_section(test),
        "tokenizer_class": "PreTrainedTokenizerFast" if hybrid else "AutoTokenizer",
        "where": shipped_where(name) if name in EMBEDDED else str(out),
        "tokenizer_note": _paragraph("tokenizer_note") if hybrid else "",
    }


def _stages_part(stages: list[dict], summary: dict) -> str:
    """The earlier stages' commands and figures, and the training time of all stages together."""
    if not stages:
        return ""
    rows = "\n".join(f"  {i}. `{shown_command(st['command'])}`: steps {st['steps']}, "
                     f"tokens {st['tokens']:,}, wall time {st['wall_seconds'] / 60:.1f} min"
                     for i, st in enumerate(stages, 1))
    total = (sum(st["wall_seconds"] for st in stages) + summary["wall_seconds"]) / 60
    return "\n" + _part("earlier_stages", n=len(stages) + 1, total=f"{total:.1f}", rows=rows)


def _layer_change(tc: dict) -> str:
    """The long intro's clause for a continued run whose layer types were overridden."""
    layers = (tc.get("model_overrides") or {}).get("layer_types")
    if not (tc.get("init_from") and layers):
        return ""
    return _part("layer_change", layer_types=", ".join(t.removesuffix("_attention") for t in layers))


def _root_source(tc: dict, stages: list[dict]) -> str:
    """What the first stage started from: a model it continued, or (trained from scratch) that stage's run."""
    if not stages:
        return shown_runs([tc["init_from"]])[0] if tc.get("init_from") else "a fresh init"
    return shown_runs([stages[0]["init_from"] or stages[0]["out"]])[0]


def format_card(out: Path, name: str, train_config: dict, summary: dict, test: dict, heldout: dict | None,
                command: str, pruning: dict | None = None, long: dict | None = None,
                stages: list[dict] | None = None) -> str:
    """The model card (README.md) of a trained model directory: card.md.tmpl filled in with `card_fields`;
    `stages`: the runs it continues (`earlier_stages`), earliest first."""
    fields = card_fields(out, name, train_config, summary, test, heldout, command, pruning, long, stages)
    return _card_parts()["card"].substitute(fields) + "\n"


def evaluate_and_write_card(out: str | os.PathLike, train_config, command: str | None = None,
                            dtype: str | torch.dtype = "auto") -> dict:
    """Evaluate a freshly trained model directory (test + held-out), write eval.json and README.md.

    `dtype` "float32" upcasts the bf16 weights exactly (computation in float32), as the shipped cards are
    evaluated on any CPU; the card records the dtype it was evaluated in.
    """
    out = Path(out)
    tc = train_config.to_dict() if hasattr(train_config, "to_dict") else dict(train_config)
    summary = json.loads((out / "train_summary.json").read_text())
    model, tok = load_trained(out, dtype=dtype)
    test = evaluate_model(out, "test", tc["eval_n_per_family"], model=model, tokenizer=tok,
                          batch_size=tc.get("eval_batch_size", 32))
    heldout = None
    if tc.get("heldout_n_per_family"):
        heldout = evaluate_model(out, "heldout", tc["heldout_n_per_family"], model=model, tokenizer=tok,
                                 batch_size=tc.get("eval_batch_size", 32))
    result = {"test": test, "heldout": heldout, "train": summary}
    if trains_long(tc):
        result["long"] = evaluate_long(model, tok, tc["eval_n_per_family"])
    atomic_write_text((out / "eval.json"), json.dumps(result, indent=2) + "\n")
    write_card(out, command)
    return result


def write_card(out: str | os.PathLike, command: str | None = None) -> Path:
    """(Re)write README.md of a trained model directory from its train_config, train_summary and eval.json."""

    out = Path(out)
    tc = json.loads((out / "train_config.json").read_text())
    ev = json.loads((out / "eval.json").read_text())
    name = card_name(tc, out)
    stages = ev.get("earlier_stages")
    if stages is None:  # recorded once, while the directories of the earlier stages are still there
        stages = earlier_stages(tc)
        if stages:
            ev["earlier_stages"] = stages
            atomic_write_text(out / "eval.json", json.dumps(ev, indent=2) + "\n")
    summary = json.loads((out / "train_summary.json").read_text())
    command = command or train_command(tc, out, trained_as(summary))
    atomic_write_text(out / "README.md", format_card(out, name, tc, ev["train"], ev["test"], ev["heldout"],
                                                     command, ev.get("pruning"), ev.get("long"), stages))
    return out / "README.md"


#: how a run was invoked when its train_summary.json does not say: every committed card's backbone was
#: trained as this module, before training moved to the lab (`ENTRY`, same options)
TRAINED_AS = "python -m slimwise.testbed.train"


def trained_as(summary: dict) -> str:
    """The command a run's train_summary.json records (`ENTRY` for runs of lab.testbed.train), else
    `TRAINED_AS`: a card prints the command that was run, so committed cards re-render bit for bit."""
    return summary.get("entry", TRAINED_AS)


def train_command(tc: dict, out: Path, entry: str = TRAINED_AS) -> str:
    """The training command line of a run's train_config (its non-default options, from the option
    declarations) as `entry` ran it, ready to paste into a shell; run directories as `shown_command` prints
    them."""
    return shown_command(command_of(entry,
                                    argv_of(TrainConfig, {"out": str(out), **tc}, TRAIN_OPTIONS,
                                            always=ALWAYS_SPELLED)))


RUN_OPTIONS = ("--out", "--init-from")


def shown_command(command: str) -> str:
    """A train command with its run directories (`--out`, `--init-from` values that are absolute paths)
    relative to the directory that holds them: train stores absolute paths, and a card must paste into any
    checkout and render the same from any working directory. A stored stage command (eval.json keeps it as
    first written) goes through here too."""
    words = shlex.split(command)
    at = [i + 1 for i, w in enumerate(words[:-1]) if w in RUN_OPTIONS]
    for i, shown in zip(at, shown_runs([words[i] for i in at]), strict=True):
        words[i] = shown
    return shlex.join(words)


def shown_runs(paths: Sequence[str]) -> list[str]:
    """Absolute run directories relative to the common parent of their parents (`/x/runs/s1`, `/x/runs/s2`
    -> `s1`, `s2`); a relative path or a shipped name (`testbed-a`) as it is."""
    absolute = [p for p in paths if Path(p).is_absolute()]
    if not absolute:
        return list(paths)
    anchor = os.path.commonpath([str(Path(p).parent) for p in absolute])
    return [os.path.relpath(p, anchor) if Path(p).is_absolute() else p for p in paths]


def earlier_stages(tc: dict) -> list[dict]:
    """The runs a continued run descends from, earliest first: each `--init-from` that is a run directory
    (train_config.json and train_summary.json beside the weights), followed until a shipped model, a fresh
    init or a directory that is gone. Each: its directory, command, `init_from`, steps, tokens and wall
    seconds."""
    from slimwise.embedded import EMBEDDED

    stages, source = [], tc.get("init_from")
    while source and source not in EMBEDDED:
        run = Path(source)
        if not ((run / "train_config.json").is_file() and (run / "train_summary.json").is_file()):
            break
        parent = json.loads((run / "train_config.json").read_text())
        summary = json.loads((run / "train_summary.json").read_text())
        stages.insert(0, {"out": str(run), "command": train_command(parent, run, trained_as(summary)),
                          "init_from": parent.get("init_from"), "steps": summary["steps"],
                          "tokens": summary["tokens"], "wall_seconds": summary["wall_seconds"]})
        source = parent.get("init_from")
    return stages


def card_name(train_config: dict, out: Path) -> str:
    """testbed-a|b|c, with "-long" for a run that trained the long-prompt families."""
    base = CARD_NAMES.get(train_config["backbone"], out.name)
    return f"{base}-long" if trains_long(train_config) and base in CARD_NAMES.values() else base


def shipped_dir(name: str) -> Path:
    """Where the checkpoint of embedded `name` lives (or will): the package's checkpoints for the one the
    wheel ships (already there), else the lab's."""
    from slimwise.embedded import CHECKPOINTS, EMBEDDED, LAB_CHECKPOINTS

    sub = EMBEDDED[name]
    return (CHECKPOINTS if (CHECKPOINTS / sub).is_dir() else LAB_CHECKPOINTS) / sub


def shipped_where(name: str) -> str:
    """`shipped_dir` relative to a source checkout's root, as the card's usage snippet names it."""
    path = shipped_dir(name)
    return path.relative_to(path.parents[3]).as_posix()


def ship(run_dir: str | os.PathLike, name: str) -> Path:
    """Copy a trained model's shippable files where its embedded name resolves, atomically: into the package
    (slimwise/testbed/checkpoints/<dir>) for the checkpoint it ships, else into the lab's
    (lab/testbed/checkpoints/<dir>)."""
    from slimwise.embedded import EMBEDDED

    if name not in EMBEDDED:
        raise SlimWiseError(f"unknown embedded name {name!r}; choose one of {sorted(EMBEDDED)}")
    dst = shipped_dir(name)
    with atomic_dir(dst) as tmp:
        copy_model_files(run_dir, tmp)
    return dst


def build_card_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab.testbed.evaluate",
                                description="model cards of trained testbed backbones")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("card",
                       help="add the pruning regime from a `slimwise eval` report and rewrite README.md")
    c.add_argument("model_dir")
    c.add_argument("--pruning-report", help="report.json of `slimwise eval` on this model (target domain)")
    c.add_argument("--pruning-command", default="slimwise eval", help="the command that wrote the report")
    c.add_argument("--ship", metavar="NAME",
                   help="then copy the model where embedded NAME resolves (e.g. testbed-a: the package)")
    e = sub.add_parser("evaluate", help="evaluate a trained model directory (a run with --no-eval) and write "
                                        "its eval.json and README.md")
    e.add_argument("model_dir")
    e.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="auto: the saved dtype (bfloat16); float32 upcasts the bf16 weights exactly, as each "
                        "shipped card was evaluated, whatever the CPU")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m lab.testbed.evaluate card|evaluate ...` with `argv` (default: sys.argv); the exit
    code."""
    args = build_card_parser().parse_args(argv)
    out = Path(args.model_dir)
    if args.command == "evaluate":
        return _evaluate_run(out, args.dtype)
    if args.pruning_report:
        _add_pruning_regime(out, args.pruning_report, args.pruning_command)
    print(write_card(out))
    if args.ship:
        print(ship(out, args.ship))
    return 0


def _evaluate_run(out: Path, dtype: str) -> int:
    """`evaluate RUN`: evaluate a finished `--no-eval` training run and write its eval.json and card."""
    config = out / "train_config.json"
    if not (config.is_file() and (out / "train_summary.json").is_file()):
        print(f"error: {out} has no train_config.json and train_summary.json: pass the --out directory of a "
              "finished `python -m lab.testbed.train` run", file=sys.stderr)
        return 2
    result = evaluate_and_write_card(out, json.loads(config.read_text()), dtype=dtype)
    t = result["test"]
    domains = ", ".join(f"{d} {v['accuracy']:.1%}" for d, v in t["domains"].items())
    weakest = min(t["families"], key=lambda f: t["families"][f]["accuracy"])
    print(f"test: {domains}; weakest family {weakest} {t['families'][weakest]['accuracy']:.1%}")
    print(out / "README.md")
    return 0


def _add_pruning_regime(out: Path, report: str, command: str) -> None:
    """`card --pruning-report`: the pruning regime of a `slimwise eval` report, into the run's eval.json."""
    ev_path = out / "eval.json"
    ev = json.loads(ev_path.read_text())
    ev["pruning"] = pruning_regime(json.loads(Path(report).read_text()), report, command)
    atomic_write_text(ev_path, json.dumps(ev, indent=2) + "\n")
    for phase, ph in ev["pruning"]["phases"].items():
        band = "in" if ph["in_band"] else "NOT in"
        print(f"{phase}: best {ph['best_criterion']}, uniform 50% costs {ph['uniform50_cost_points']:.1f} "
              f"points, length {ph['uniform50_length_change_pct']:+.1f}% -> {band} band")


if __name__ == "__main__":
    raise SystemExit(main())
