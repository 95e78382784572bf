"""The trained testbed backbones shipped in the package (slimwise/testbed/checkpoints).

Checked here, on the shipped files: the architecture the testbed promises, size and dtype, the model card's
figures against the files beside it, the quality bars the card reports (and a fresh sample of them with stock
transformers), transformers == vLLM greedy tokens, and the colocated plugin on the backbones (empty plan ==
stock vLLM, plan == the reference engine's SlimWise mode with exact prompt/decode counters, compiled ==
eager). testbed-c (the hybrid Qwen3.5/3.6-MoE backbone) runs in vLLM in bfloat16 only on CPU, so its vLLM
check is greedy consistency with the float32 reference (`test_vllm_serves_the_hybrid_backbone`), as in
tests/test_vllm_hybrid.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from slimwise.calibrate import CalibrationConfig, calibrate
from slimwise.criteria import plan_from_stats
from slimwise.embedded import EMBEDDED, embedded_model_dir
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.hardware import bf16_support
from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import make_split
from slimwise.testbed.long_tasks import LENGTHS

pytestmark = pytest.mark.vllm_in_process  # its vLLM engines (tests/conftest.py)
NAMES = sorted(EMBEDDED)  # testbed-a, -b, -c, and testbed-a-long, -c-long (continued on long prompts)
LONG_NAMES = [n for n in NAMES if n.endswith("-long")]
# float32 token equality; testbed-c: bf16 only, checked below. testbed-a-long (testbed-a's architecture with
# more positions) on its own long prompts: `test_vllm_answers_long_prompts_as_the_reference`.
VLLM_NAMES = ["testbed-a", "testbed-b"]
#: (target-domain accuracy, weakest family) each shipped card must reach: the testbed's quality bars, on every
#: backbone (the card's "Quality bars" line).
BARS = dict.fromkeys(NAMES, (0.85, 0.60))
EOS = 0  # the testbed tokenizer's <|endoftext|>, checked below; both engines stop on it
CONFIG = GenerationConfig(max_new_tokens=48, batch_size=16, eos_token_id=EOS)
#: Card checks run in the dtype the card records, where this CPU runs it natively: a float32 card (testbed-c)
#: in float32 everywhere; a bf16 card in bf16 where the CPU has bf16 matrix instructions, and exactly upcast
#: to float32 where it has none (AVX2 only: bf16 is emulated there, far slower, and the upcast scores
#: within 2 problems of the bf16 card per family; see docs/reproducibility.md). So the card test depends on
#: the CPU only through that choice, and its tolerance is in problems, not in floating-point shares.
CARD_TOLERANCE = 3  # problems per family (of the card's 100): bf16 kernels round differently between CPUs


def card_dtype(card: dict) -> torch.dtype:
    if card.get("dtype", "bfloat16") == "float32" or not bf16_support():
        return torch.float32
    return torch.bfloat16


# the other shipped-model checks (bf16 weights)
HF_DTYPE = torch.bfloat16 if bf16_support() else torch.float32


def test_every_backbone_is_shipped():
    assert [n for n in NAMES if embedded_model_dir(n) is None] == []


@pytest.mark.parametrize("name", NAMES)
def test_architecture_size_and_dtype(name):
    path = embedded_model_dir(name)
    cfg = json.loads((path / "config.json").read_text())
    if name in LONG_NAMES:  # a whole long prompt and its answer fit
        assert cfg["max_position_embeddings"] >= LENGTHS[-1] + 128
    name = name.removesuffix("-long")
    if name == "testbed-a":  # fine-grained, like Qwen3-30B-A3B
        assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["norm_topk_prob"] is True
        assert cfg["num_experts"] >= 64 and cfg["num_experts_per_tok"] == 8
    elif name == "testbed-c":  # Qwen3.6-35B-A3B's hybrid design: Gated-DeltaNet : full attention 3 : 1
        assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["model_type"] == "qwen3_5_moe_text"
        if path.name.endswith("-long"):  # still hybrid; lookup needed a full-attention layer before the last
            layers = cfg["num_hidden_layers"]
            assert cfg["layer_types"] == ["linear_attention", "full_attention"] * (layers // 2)
        else:
            assert cfg["layer_types"] \
                == (["linear_attention"] * 3 + ["full_attention"]) * (cfg["num_hidden_layers"] // 4)
        assert cfg["num_experts"] >= 64 and cfg["num_experts_per_tok"] == 8
        assert cfg["shared_expert_intermediate_size"] % 32 == 0 and cfg["shared_expert_intermediate_size"] > 0
        assert cfg["linear_key_head_dim"] == cfg["linear_value_head_dim"] == 64  # vLLM's CPU GDN kernel
    else:  # routed + shared expert with its gate, like Qwen1.5-MoE
        assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["shared_expert_intermediate_size"] > 0
        assert cfg["num_experts"] >= 32
    assert cfg["hidden_size"] % 32 == 0 and cfg["moe_intermediate_size"] % 32 == 0  # vLLM CPU kernels
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= 30e6
    with safe_open(weights, "pt") as f:
        assert {f.get_slice(k).get_dtype()
                for k in f.keys()} == {"BF16"}  # noqa: SIM118 (safe_open is not iterable)
    assert cfg["vocab_size"] == len(load_tokenizer(path))


def card_table(card: str, header: str) -> dict[str, list[str]]:
    """The markdown table of the card whose header starts with `| header |`: first cell -> the other cells."""
    lines = card.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    rows = {}
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2:]):
        first, *rest = (cell.strip() for cell in line.strip("|").split("|"))
        rows[first] = rest
    return rows


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def accuracy_by_domain(split: dict) -> dict[str, float]:
    """Per domain and over all ("all"), from the per-family counts alone."""
    counts: dict[str, list[int]] = {}
    for r in split["families"].values():
        for key in (r["domain"], "all"):
            c = counts.setdefault(key, [0, 0])
            c[0] += round(r["accuracy"] * r["n"])
            c[1] += r["n"]
    return {key: correct / n for key, (correct, n) in counts.items()}


@pytest.mark.parametrize("name", NAMES)
def test_the_card_states_the_shipped_files(name):
    """The card's figures recomputed from the files it ships with, by another route than the card writer's:
    parameter counts and sizes from the safetensors shapes (the writer counts a loaded model), domain and
    overall accuracies and the quality-bar verdicts from eval.json's per-family counts (the writer prints
    its per-domain figures), throughput from train_summary.json's tokens and wall time; and the card's
    usage snippet names this directory and a tokenizer class that loads the tokenizer as trained
    (testbed-c: not AutoTokenizer)."""
    path = embedded_model_dir(name)
    card = (path / "README.md").read_text()
    cfg = json.loads((path / "config.json").read_text())
    with safe_open(path / "model.safetensors", "pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    routed = [k for k in shapes if re.search(r"\.mlp\.experts\.\d+\.", k)]
    experts = {re.search(r"\.experts\.(\d+)\.", k).group(1) for k in routed}
    layers = {re.search(r"\.layers\.(\d+)\.", k).group(1) for k in shapes if ".layers." in k}
    vocab, hidden = shapes["model.embed_tokens.weight"]
    total, in_experts = sum(map(math.prod, shapes.values())), sum(math.prod(shapes[k]) for k in routed)
    active = total - in_experts + in_experts * cfg["num_experts_per_tok"] / len(experts)
    arch = {k: v[0] for k, v in card_table(card, "field").items()}
    assert (arch["layers"], arch["hidden size"], arch["vocab size"]) \
        == (str(len(layers)), str(hidden), str(vocab))
    assert arch["routed experts / top-k"] == f"{len(experts)} / {cfg['num_experts_per_tok']}"
    assert arch["parameters (total / routed experts / active per token)"] == (
        f"{total / 1e6:.2f}M / {in_experts / 1e6:.2f}M / {active / 1e6:.2f}M")
    assert arch["weights"] == ("bfloat16 safetensors, "
                               f"{(path / 'model.safetensors').stat().st_size / 1e6:.1f} MB")

    ev = json.loads((path / "eval.json").read_text())
    test, heldout = accuracy_by_domain(ev["test"]), accuracy_by_domain(ev["heldout"])
    assert card_table(card, "domain") == {d: [pct(test[d]), pct(heldout[d])] for d in test}
    weakest, low = min(((f, r["accuracy"]) for f, r in ev["test"]["families"].items()), key=lambda fa: fa[1])
    verdict = {True: "met", False: "NOT met"}
    assert (f"arithmetic domain >= 85% -> {pct(test['arithmetic'])} ({verdict[test['arithmetic'] >= 0.85]}); "
            f"every family >= 60% -> weakest {weakest} {pct(low)} ({verdict[low >= 0.6]})") in card
    # the pruning section names as many criteria as its source report ran
    source = json.loads((Path(__file__).resolve().parents[1] / ev["pruning"]["source"]).read_text())
    criteria = sorted({r["criterion"] for r in source["runs"]})
    assert ev["pruning"]["criteria"] == criteria
    assert f"with the best of the {('one', 'two', 'three', 'four')[len(criteria) - 1]} criteria" in card
    s = json.loads((path / "train_summary.json").read_text())
    assert (f"- steps {s['steps']}, tokens {s['tokens']:,} (real tokens, padding excluded), wall time "
            f"{s['wall_seconds'] / 60:.1f} min, {s['tokens'] / s['wall_seconds']:.0f} tokens/s") in card

    where = "/".join(path.parts[-4:])  # slimwise/testbed/checkpoints/<dir>
    snippet = re.search(r'^tok = (\w+)\.from_pretrained\("([^"]+)"\)$', card, re.M)
    assert snippet and snippet.group(2) == where and f'from_pretrained("{where}")' in card
    tok = getattr(transformers, snippet.group(1)).from_pretrained(path)
    ids = tok("add 457+68\n").input_ids
    assert tok.decode(ids[:1]) == "add" and len(ids) == 9 and tok.decode(ids) == "add 457+68\n", ids


@pytest.mark.parametrize("name", NAMES)
def test_the_cards_command_trains_this_run(name):
    """The card's training command, pasted into a shell, parses to the options of the run that made the
    shipped files (train_config.json): the command is the recipe, not a paraphrase of it."""
    import shlex

    from lab.testbed.train import build_parser
    from lab.testbed.train_config import TRAIN_OPTIONS, TrainConfig
    from slimwise.options import config_from_args

    path = embedded_model_dir(name)
    command = re.search(r"^- command: `([^`]+)`", (path / "README.md").read_text(), re.M).group(1)
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "slimwise.testbed.train"]
    parsed = dataclasses.asdict(config_from_args(TrainConfig, build_parser().parse_args(words[3:])))
    trained = json.loads((path / "train_config.json").read_text())
    for key in ("out", "init_from"):  # train stores absolute paths, the card prints them where they live
        shown, stored = parsed[key], trained.get(key)
        if shown and stored and not Path(shown).is_absolute() and Path(stored).is_absolute():
            assert Path(stored).parts[-len(Path(shown).parts):] == Path(shown).parts, (shown, stored)
            parsed[key] = stored
    differ = {k: (parsed[k], trained.get(k)) for k in TRAIN_OPTIONS if parsed[k] != trained.get(k, parsed[k])}
    assert differ == {}


@pytest.mark.parametrize("name", NAMES)
def test_slimwise_loads_the_tokenizer_as_saved(name):
    """Template words are single tokens, as the model was trained; AutoTokenizer next to testbed-c's
    qwen3_5_moe_text config would substitute Qwen3.5's tokenizer class and spell them out."""
    from lab.testbed.tokenizer import load_saved_tokenizer as testbed_tokenizer

    path = embedded_model_dir(name)
    for tok in (load_tokenizer(path), testbed_tokenizer(path)):
        ids = tok.encode("add 457+68\n", add_special_tokens=False)
        assert tok.decode(ids[:1]) == "add" and len(ids) == 9 and tok.decode(ids) == "add 457+68\n", ids


def card_eval(name: str) -> dict:
    return json.loads((embedded_model_dir(name) / "eval.json").read_text())


@pytest.mark.slow  # re-evaluates each shipped model on its test split
@pytest.mark.parametrize("name", [n if n == "testbed-a" else pytest.param(n, marks=pytest.mark.matrix)
                                  for n in NAMES])  # CI: testbed-a; the others: make test-matrix
def test_the_card_is_the_model_and_meets_the_bars(name):
    """Re-run the card's own test evaluation (100 problems per family, seed 0, stock transformers classes and
    experts, in the card's dtype: `card_dtype`) and check (1) the card's figures are this model's: per-family
    correct answers within CARD_TOLERANCE problems and the routing load within 0.05; (2) the quality bars on
    the recomputed figures: >= 85% on the target domain, >= 60% on every family, the busiest expert <= 3x
    uniform. Counts, not shares: 0.75 - 0.72 > 0.03 in floating point failed a 3-problem difference on an
    AVX512-BF16 CPU. 30-60 s per model."""
    from transformers import AutoModelForCausalLM

    from lab.testbed.evaluate import evaluate_model

    card = card_eval(name)["test"]
    path = embedded_model_dir(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=card_dtype(card)).eval()
    # the checkpoint's own tokenizer (AutoTokenizer would swap in Qwen3.5's class next to testbed-c's config)
    # batch 128 (the card used 32): faster, and inside the tolerance below (docs/history/test-tolerances.md)
    r = evaluate_model(model=model, tokenizer=load_tokenizer(path), split="test",
                       n_per_family=card["n_per_family"], seed=card["seed"],
                       max_new_tokens=card["max_new_tokens"], batch_size=128)
    got = {f: round(v["accuracy"] * v["n"]) for f, v in r["families"].items()}
    want = {f: round(v["accuracy"] * v["n"]) for f, v in card["families"].items()}
    assert got.keys() == want.keys()
    assert all(abs(got[f] - want[f]) <= CARD_TOLERANCE for f in got), {f: (got[f], want[f]) for f in got}
    got = {f: v["accuracy"] for f, v in r["families"].items()}
    target, weakest = BARS[name]
    assert r["domains"]["arithmetic"]["accuracy"] >= target, r["domains"]
    assert min(got.values()) >= weakest, got
    assert r["eos_share"] >= 0.95
    shares = r["routing"]["max_share_over_uniform"]
    assert max(shares) <= 3.0
    assert shares == pytest.approx(card["routing"]["max_share_over_uniform"], abs=0.05)
    card_text = (path / "README.md").read_text()
    assert all(f"| {family} |" in card_text for family in got)  # per-family accuracy in the card


@pytest.mark.parametrize("name", NAMES)
def test_pruning_band_on_a_fresh_sample(name):
    """Re-measure the band: decode-phase calibration on the calib split, the card's best criterion, uniform
    50% on unseen arithmetic problems (seed 1; 60 problems, so the bounds carry sample slack)."""
    from slimwise.testbed import grade

    path = embedded_model_dir(name)
    criterion = card_eval(name)["pruning"]["phases"]["decode"]["best_criterion"]
    model, tok = load_model(path, dtype=HF_DTYPE), load_tokenizer(path)
    calib = [s.prompt for s in make_split("calib", 16, domain="arithmetic")]
    stats = calibrate(model, calib, tok,
                      CalibrationConfig(phase="decode", max_new_tokens=128), progress=False)
    engine = PhaseSplitEngine(model, tok, plan=plan_from_stats(stats, criterion, 0.5))
    samples = make_split("test", 12, seed=1, domain="arithmetic")
    gen = GenerationConfig(max_new_tokens=160, batch_size=32)
    result = {}
    for mode in ("full", "uniform"):
        outs = engine.generate([s.prompt for s in samples], mode, gen)
        acc = sum(grade(s, o.text or "", o.finish_reason == "eos").correct
                  for s, o in zip(samples, outs, strict=True))
        result[mode] = (acc / len(samples), sum(len(o.token_ids) for o in outs) / len(outs))
    (full_acc, full_len), (uni_acc, uni_len) = result["full"], result["uniform"]
    assert full_acc - uni_acc >= 0.10 or abs(uni_len / full_len - 1) >= 0.15, result  # pruning matters
    assert uni_acc >= 0.20, result  # slack (bar 0.30 on 240 problems)


@pytest.fixture(scope="module")
def reference():
    """name -> (text prompts, 50% REAP plan from decode-phase calibration, empty plan,
    reference tokens per mode). The prompts are text, as a user sends them (the OpenAI client, `LLM.generate`
    with strings): each engine encodes them with the checkpoint's own tokenizer, so a tokenizer that differs
    between transformers and vLLM shows as different tokens."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path = embedded_model_dir(name)
            tok = load_tokenizer(path)
            assert tok.eos_token_id == EOS
            model = load_model(path, dtype="float32")  # vLLM below runs float32 too: token-exact comparison
            prompts = [s.prompt for s in make_split("test", 2, seed=3)]
            calib = [tok.encode(s.prompt, add_special_tokens=False)
                     for s in make_split("calib", 4, seed=0, domain="arithmetic")]
            stats = calibrate(model, calib, config=CalibrationConfig(max_new_tokens=48), progress=False)
            plan = plan_from_stats(stats, "reap", 0.5)
            engine = PhaseSplitEngine(model, tok, plan=plan)
            ref = {m: [o.token_ids for o in engine.generate(prompts, m, CONFIG)]
                   for m in ("full", "slimwise")}
            cache[name] = (prompts, plan, plan_from_stats(stats, "reap", 0.0), ref)
        return cache[name]

    return get


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("name", VLLM_NAMES)
def test_vllm_equals_transformers_and_plugin_equals_reference(name, reference):
    from slimwise.engines.vllm_engine import VllmEngine

    prompts, plan, _, ref = reference(name)
    assert ref["slimwise"] != ref["full"]  # the plan changes outputs: the comparison can fail
    # testbed-a compiled (torch.compile traces the gate hook once), the others eager: both equal the reference
    engine = VllmEngine(embedded_model_dir(name), plan, enforce_eager=name != "testbed-a")
    try:
        assert [o.token_ids for o in engine.generate(prompts, "full", CONFIG)] == ref["full"]  # stock vLLM
        assert [o.token_ids for o in engine.generate(prompts, "slimwise", CONFIG)] == ref["slimwise"]
        c = engine.counters()[0]
        tok = load_tokenizer(embedded_model_dir(name))
        n_prompt = sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
        n_fed_back = sum(len(t) - 1 for t in ref["slimwise"])
        assert (c["pruned_tokens"], c["full_tokens"]) == (n_fed_back, n_prompt)  # prompt tokens never pruned
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_answers_long_prompts_as_the_reference():
    """testbed-a-long in vLLM (float32) on text prompts of 1,024 characters from the long-prompt families,
    the engine given no tokenizer (it loads the checkpoint's own for text): full (stock vLLM) and SlimWise
    with a 50% REAP plan from decode-phase calibration on long problems equal the float32 reference token for
    token, every prompt token runs the full model, and the answers are the model's (graded: not merely equal
    garbage)."""
    from slimwise.engines.vllm_engine import VllmEngine
    from slimwise.testbed import grade
    from slimwise.testbed.long_tasks import make_long_split

    name = "testbed-a-long"
    path = embedded_model_dir(name)
    tok = load_tokenizer(path)
    model = load_model(path, dtype="float32")
    samples = make_long_split("test", 3, LENGTHS[-1], seed=5)
    prompts = [s.prompt for s in samples]
    calib = [tok.encode(s.prompt, add_special_tokens=False) for s in make_long_split("calib", 2, LENGTHS[-1])]
    stats = calibrate(model, calib, config=CalibrationConfig(max_new_tokens=24), progress=False)
    plan = plan_from_stats(stats, "reap", 0.5)
    reference = PhaseSplitEngine(model, tok, plan=plan)
    ref = {m: reference.generate(prompts, m, CONFIG) for m in ("full", "slimwise")}
    tokens = {m: [o.token_ids for o in outs] for m, outs in ref.items()}
    assert tokens["slimwise"] != tokens["full"]  # the plan changes outputs: the comparison can fail
    right = sum(grade(s, o.text or "", o.finish_reason == "eos").correct
                for s, o in zip(samples, ref["full"], strict=True))
    assert right >= len(samples) // 2, f"full answers {right} of {len(samples)} long prompts"
    engine = VllmEngine(path, plan)
    try:
        for mode in ("full", "slimwise"):
            assert [o.token_ids for o in engine.generate(prompts, mode, CONFIG)] == tokens[mode], mode
        c = engine.counters()[0]
        n_prompt = sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
        assert n_prompt > 200 * len(prompts)  # long prompts, as the families promise
        n_fed_back = sum(len(t) - 1 for t in tokens["slimwise"])
        assert (c["pruned_tokens"], c["full_tokens"]) == (n_fed_back, n_prompt)
    finally:
        engine.close()
    # token ids first start a tokenizer-free engine: text after them is one clear line, not a TypeError
    engine = VllmEngine(path, plan)
    try:
        engine.generate([tok.encode(prompts[0], add_special_tokens=False)], "full", CONFIG)
        with pytest.raises(SlimWiseError, match="engine started without a tokenizer"):
            engine.generate(prompts[:1], "full", CONFIG)
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_empty_plan_on_backbone_a(reference):
    from slimwise.engines.vllm_engine import VllmEngine

    prompts, plan, empty, ref = reference("testbed-a")
    assert empty.is_empty
    engine = VllmEngine(embedded_model_dir("testbed-a"), empty)
    try:
        assert [o.token_ids for o in engine.generate(prompts, "slimwise", CONFIG)] == ref["full"]
        assert engine.counters() == [{}]  # nothing installed: the stock model runs
    finally:
        engine.close()


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_hybrid_backbone(reference):
    """testbed-c in vLLM (bf16, the CPU Gated DeltaNet kernel's only dtype), full, SlimWise and uniform in one
    engine: exact prompt/decode counters, and every token vLLM chose is within bf16 noise of the float32
    reference's best under the routing its mode promises (mean log-prob gap, as in
    tests/test_vllm_hybrid.py)."""
    from test_vllm_hybrid import MEAN_GAP, mean_gap

    from slimwise.engines.vllm_engine import VllmEngine

    prompts, plan, _, ref = reference("testbed-c")
    assert ref["slimwise"] != ref["full"]  # the plan changes outputs
    tok = load_tokenizer(embedded_model_dir("testbed-c"))
    engine = VllmEngine(embedded_model_dir("testbed-c"), plan, dtype="bfloat16", share_engine=True)
    try:
        got = {}
        for mode in ("full", "slimwise", "uniform"):
            got[mode] = [o.token_ids for o in engine.generate(prompts, mode, CONFIG)]
            c = engine.counters()[0]
            n_prompt = sum(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
            n_fed_back = sum(len(t) - 1 for t in got[mode])
            pruned = {"full": 0, "slimwise": n_fed_back, "uniform": n_prompt + n_fed_back}[mode]
            assert (c["pruned_tokens"], c["full_tokens"]) == (pruned, n_prompt + n_fed_back - pruned)
            assert c["position_mismatch_steps"] == 0
    finally:
        engine.close()
    with PhaseSplitEngine(load_model(embedded_model_dir("testbed-c"), dtype="float32"), tok,
                          plan=plan) as reference_engine:
        for mode in ("full", "slimwise", "uniform"):
            gap = mean_gap(reference_engine, mode, got[mode], reference_engine.encode(prompts))
            assert gap <= MEAN_GAP, (mode, gap)
    same = {m: sum(a == b for a, b in zip(got[m], ref[m], strict=True)) / len(prompts) for m in ref}
    assert min(same.values()) >= 0.5, same  # whole sequences equal to the float32 reference's greedy ones


def test_tensor_dtype_roundtrip_sanity():
    """bf16 on disk is what the model card promises; loading as float32 is exact (bf16 embeds in fp32)."""
    path = embedded_model_dir("testbed-a")
    a = load_model(path, dtype="float32")
    b = load_model(path, dtype="bfloat16")
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q.float()), n


@pytest.mark.slow
def test_small_eval_run_on_a_backbone(tmp_path):
    """`slimwise eval` end to end on a shipped backbone: report, plots, and the method's ordering on its
    headline plan (full >= SlimWise >= uniform at 50%, within the sample's noise)."""
    from slimwise.cli import main as cli_main

    out = tmp_path / "eval"
    assert cli_main(["eval", "testbed-b", "--dtype", str(HF_DTYPE).removeprefix("torch."),
                     "--criteria", "reap", "--ratios", "0.5", "--phases", "decode", "--per-family", "8",
                     "--calib-per-family", "8", "--threads", "1", "--out", str(out),
                     "--cache-dir", str(tmp_path / "cache"), "--other-per-family", "4",
                     "--calib-mix", "all"]) == 0
    report = json.loads((out / "report.json").read_text())
    acc = {r["mode"]: r["metrics"]["accuracy"] for r in report["runs"] if r["phase"] == "decode"}
    assert report["full"]["accuracy"] >= 0.6 and report["tasks"]["n"] == 40
    assert acc["slimwise"] >= acc["uniform"] - 0.05  # SlimWise does not lose to classic pruning
    assert all((out / name).read_bytes()[:4] == b"\x89PNG" for name in report["plots"])
    assert "## Plots" in (out / "report.md").read_text() and "transfer.png" in report["plots"]
    # the default sweep's transfer view: the target-calibrated plan and the mixed
    # one, on 32 other-domain problems
    assert report["other_domains"]["n"] == 32 \
        and {r["phase"] for r in report["runs"]} == {"decode", "decode@all"}


@pytest.mark.parametrize("name", LONG_NAMES)
def test_the_long_prompt_card_states_its_figures(name):
    """The long-prompt table and bar of the card recomputed from eval.json's per-family counts."""
    from lab.testbed.evaluate import LONG_BAR

    path = embedded_model_dir(name)
    card, long = (path / "README.md").read_text(), card_eval(name)["long"]
    table = card_table(card, "prompt length (characters)")
    assert list(table) == [f"{n:,}" for n in LENGTHS]
    for n in LENGTHS:
        fams = long["lengths"][str(n)]["families"]
        correct = sum(round(f["accuracy"] * f["n"]) for f in fams.values())
        overall = correct / sum(f["n"] for f in fams.values())
        assert table[f"{n:,}"][1:] == [pct(f["accuracy"]) for f in fams.values()] + [pct(overall)]
    top = long["lengths"][str(LENGTHS[-1])]
    assert top["max_prompt_tokens"] <= LENGTHS[-1]
    met = top["accuracy"] >= LONG_BAR
    assert f"-> {pct(top['accuracy'])} ({'met' if met else 'NOT met'})." in card
    assert ("Shipped below this bar" in card) is not met


@pytest.mark.slow  # 60 prompts of about 1,000 tokens per model
@pytest.mark.parametrize("name", LONG_NAMES)
def test_the_long_prompt_bar_on_a_fresh_sample(name):
    """The long families at the longest length on problems the card never saw (seed 1, 20 per family): within
    sample slack (0.15, about 2.4 standard errors on 60 problems) of the card's figure on 300, or of the 80%
    bar where the card is above it."""
    from lab.testbed.evaluate import LONG_BAR, evaluate_long

    path = embedded_model_dir(name)
    card = card_eval(name)["long"]["lengths"][str(LENGTHS[-1])]["accuracy"]
    model = load_model(path, dtype="float32")
    r = evaluate_long(model, load_tokenizer(path), 20, (LENGTHS[-1],), seed=1, batch_size=20)
    top = r["lengths"][str(LENGTHS[-1])]
    per_family = {f: v["accuracy"] for f, v in top["families"].items()}
    assert top["accuracy"] >= min(card, LONG_BAR) - 0.15, per_family


@pytest.mark.parametrize("name", LONG_NAMES)
def test_calibration_and_slimwise_decode_at_the_longest_prompt(name, recwarn):
    """Prompt-phase calibration counts every token of 1,024-character prompts (no truncation), and a plan
    from it decodes them in SlimWise mode without running past the positions the model has (the reference
    engine warns when it would)."""
    from lab.testbed.tokenizer import encode_sample
    from slimwise.testbed.long_tasks import make_long_split

    path = embedded_model_dir(name)
    model, tok = load_model(path, dtype="float32"), load_tokenizer(path)
    samples = make_long_split("calib", 2, LENGTHS[-1])
    stats = calibrate(model, [s.prompt for s in samples], tok, CalibrationConfig(phase="prompt"),
                      progress=False)
    prompt_tokens = sum(len(encode_sample(tok, s)[0]) for s in samples)
    assert prompt_tokens >= 0.75 * LENGTHS[-1] * len(samples)
    assert stats.tokens.tolist() == [prompt_tokens] * len(stats.layers)
    engine = PhaseSplitEngine(model, tok, plan=plan_from_stats(stats, "reap", 0.5))
    outs = engine.generate([s.prompt for s in samples], "slimwise", GenerationConfig(max_new_tokens=32))
    assert all(o.token_ids for o in outs)
    assert not [w for w in recwarn if "max_position_embeddings" in str(w.message)]
