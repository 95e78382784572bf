"""lm-eval bridge: loglikelihood scores the continuation with the pruned decoder over the full model's context
cache, generate_until is phase-split generation, and lm-eval runs a local YAML task over the testbed's JSONL
fully offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before lm_eval imports datasets
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("lm_eval")  # the `eval` extra

import torch  # noqa: E402
from conftest import random_prompts  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from tiny import save_tiny_model  # noqa: E402

from lab.testbed.tokenizer import build_tokenizer  # noqa: E402
from slimwise.calibrate import CalibrationConfig, calibrate  # noqa: E402
from slimwise.criteria import plan_from_stats  # noqa: E402
from slimwise.engines.reference import GenerationConfig, PhaseSplitEngine  # noqa: E402
from slimwise.errors import SlimWiseError  # noqa: E402
from slimwise.evaluation.lm_eval_bridge import SlimWiseLM  # noqa: E402
from slimwise.export import export_pruned  # noqa: E402
from slimwise.masking import ExpertMask  # noqa: E402
from slimwise.models import load_model, load_tokenizer  # noqa: E402
from slimwise.testbed import EOS_TOKEN, make_split  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen3-MoE with the testbed tokenizer, a 50% REAP plan, its exported checkpoint, testbed
    JSONL."""
    root = tmp_path_factory.mktemp("lmeval")
    model_dir = save_tiny_model("qwen3_moe", root / "model", initializer_range=0.15)
    build_tokenizer(model_dir)
    model = load_model(model_dir)
    stats = calibrate(
        model, random_prompts(6, vocab=150), config=CalibrationConfig(max_new_tokens=6), progress=False
    )
    plan = plan_from_stats(stats, "reap", 0.5)
    plan.save(root / "plan.json")
    export_pruned(load_model(model_dir), plan, root / "pruned", source_dir=model_dir)
    samples = make_split("test", 2, seed=0, domain="arithmetic")
    with (root / "test.jsonl").open("w") as f:
        for i, s in enumerate(samples):
            wrong = samples[(i + 1) % len(samples)].target
            f.write(json.dumps({"prompt": s.prompt, "answer": s.answer, "family": s.family,
                                "choices": [s.target, wrong], "label": 0}) + "\n")
    return {"root": root, "model": model_dir, "plan": root / "plan.json", "pruned": root / "pruned",
            "data": root / "test.jsonl", "samples": samples}


def req(kind: str, *args) -> Instance:
    return Instance(kind, {}, tuple(args), 0)


def plain_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Reference: one forward of the full model over context + continuation (trailing whitespace of the
    context belongs to the continuation, lm-eval's HF convention)."""
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(context + continuation, add_special_tokens=False)["input_ids"][len(ctx):]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ctx + cont])).logits[0].float()
    logp = torch.log_softmax(logits, -1)[len(ctx) - 1:-1]
    return float(logp.gather(-1, torch.tensor(cont)[:, None]).sum())


def test_loglikelihood_full_mode_is_the_plain_model(setup):
    lm = SlimWiseLM(pretrained=str(setup["model"]), mode="full")
    model, tok = lm.engine.model, lm.tokenizer
    pairs = [("add 12+30\n", "1+0+0=1"), ("sub 9-4\n", "9-4-0=5, 5\n#### 5"), ("hello", " world")]
    out = lm.loglikelihood([req("loglikelihood", c, x) for c, x in pairs])
    for (c, x), (lp, _) in zip(pairs, out, strict=True):
        assert lp == pytest.approx(plain_logprob(model, tok, c, x), abs=1e-4)
    # a continuation made of the model's own greedy tokens is greedy
    ids = tok("add 12+30\n", add_special_tokens=False)["input_ids"]
    greedy = lm.engine.generate([ids], "full", GenerationConfig(max_new_tokens=5, eos_token_id=-1))[0]
    (lp, is_greedy), (_, other) = lm.score([(ids, greedy.token_ids), (ids, [greedy.token_ids[0] + 1])])
    assert is_greedy and not other and lp < 0


def test_loglikelihood_slimwise_is_pruned_decode_on_the_full_cache(setup):
    sw = SlimWiseLM(pretrained=str(setup["model"]), plan=str(setup["plan"]))
    full = SlimWiseLM(pretrained=str(setup["model"]), mode="full")
    sliced = SlimWiseLM(pretrained=str(setup["model"]), decode_model=str(setup["pruned"]))
    uniform = SlimWiseLM(pretrained=str(setup["model"]), plan=str(setup["plan"]), mode="uniform")
    context, cont = "add 123+45", "\n3+5+0=8, 8\n2+4+0=6, 68"
    reqs = [req("loglikelihood", context, cont), req("loglikelihood", context, "\n")]  # "\n" is one token
    (lp_sw, _), (first_sw, _) = sw.loglikelihood(reqs)
    (lp_full, _), (first_full, _) = full.loglikelihood(reqs)
    (lp_sliced, _), _ = sliced.loglikelihood(reqs)
    (_, _), (first_uni, _) = uniform.loglikelihood(reqs)
    assert first_sw == first_full  # the first continuation token is scored by the full model's prefill
    assert first_uni != first_full
    assert lp_sw != pytest.approx(lp_full, abs=1e-3)  # the rest by the pruned decoder
    assert lp_sw == pytest.approx(lp_sliced, abs=1e-4)  # masked view == exported checkpoint

    # independent reference: full-model prefill with use_cache, then the masked model on that cache
    model, tok = load_model(setup["model"]), load_tokenizer(setup["model"])
    ctx = tok(context, add_special_tokens=False)["input_ids"]
    ids = tok(context + cont, add_special_tokens=False)["input_ids"][len(ctx):]
    mask = ExpertMask(model, sw.engine.plan)
    with torch.no_grad():
        pre = model(input_ids=torch.tensor([ctx]), use_cache=True)
        with mask.pruned(True):
            rest = model(
                input_ids=torch.tensor([ids[:-1]]), past_key_values=pre.past_key_values, use_cache=True
            )
    logp = torch.log_softmax(torch.cat([pre.logits[:, -1:], rest.logits], 1)[0].float(), -1)
    assert lp_sw == pytest.approx(float(logp.gather(-1, torch.tensor(ids)[:, None]).sum()), abs=1e-4)
    mask.remove()


def test_generate_until_is_phase_split_generation(setup):
    lm = SlimWiseLM(pretrained=str(setup["model"]), plan=str(setup["plan"]), batch_size=3)
    prompts = [s.prompt for s in setup["samples"][:4]]
    kwargs = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    texts = lm.generate_until([req("generate_until", p, dict(kwargs)) for p in prompts])
    engine = PhaseSplitEngine(load_model(setup["model"]), load_tokenizer(setup["model"]), plan=lm.engine.plan)
    ref = engine.generate(prompts, "slimwise", GenerationConfig(max_new_tokens=12, stop=("\n\n", EOS_TOKEN)))
    assert texts == [g.text.split("\n\n")[0] for g in ref]
    engine.close()


def test_distilled_mode_judges_the_distilled_decoder(setup, tmp_path):
    from slimwise.distill import DistillConfig, distill
    from slimwise.plan import PrunePlan

    model, tok = load_model(setup["model"]), load_tokenizer(setup["model"])
    delta = distill(model, PrunePlan.load(setup["plan"]), random_prompts(8, vocab=150, seed=3), tok,
                    DistillConfig(steps=3, batch_size=8, max_new_tokens=6, lr=5e-2, progress=False))
    delta.save(tmp_path / "delta")
    args = dict(pretrained=str(setup["model"]), plan=str(setup["plan"]))
    dist = SlimWiseLM(**args, delta=str(tmp_path / "delta"), mode="distilled")
    sw, full = SlimWiseLM(**args), SlimWiseLM(pretrained=str(setup["model"]), mode="full")
    reqs = [
        req("loglikelihood", "add 123+45", "\n3+5+0=8, 8\n2+4+0=6, 68"),
        req("loglikelihood", "add 123+45", "\n"),
    ]
    (lp_d, _), (first_d, _) = dist.loglikelihood(reqs)
    (lp_s, _), _ = sw.loglikelihood(reqs)
    _, (first_f, _) = full.loglikelihood(reqs)
    assert first_d == first_f and lp_d != pytest.approx(lp_s, abs=1e-5)
    with pytest.raises(SlimWiseError, match="needs delta"):
        SlimWiseLM(**args, mode="distilled")


def test_rolling_and_refusals(setup):
    lm = SlimWiseLM(pretrained=str(setup["model"]), mode="full", max_length=16)
    text = "add 12+30\n2+0+0=2, 2\n1+3+0=4, 42\n#### 42"
    (total,) = lm.loglikelihood_rolling([req("loglikelihood_rolling", text)])
    assert total < 0 and torch.isfinite(torch.tensor(total))
    with pytest.raises(SlimWiseError, match="needs plan"):
        SlimWiseLM(pretrained=str(setup["model"]), mode="slimwise")


def write_tasks(setup, where) -> list[str]:
    data = str(setup["data"])
    gen = f"""task: slimwise_testbed_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["{EOS_TOKEN}"]
  max_gen_toks: 12
  do_sample: false
filter_list:
  - name: final-answer
    filter:
      - function: regex
        regex_pattern: "#### (.*)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
    mc = f"""task: slimwise_testbed_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""
    (where / "gen.yaml").write_text(gen)
    (where / "mc.yaml").write_text(mc)
    return ["slimwise_testbed_gen", "slimwise_testbed_mc"]


def test_lm_eval_offline_yaml_task(setup, tmp_path, monkeypatch):
    import datasets
    import lm_eval
    from lm_eval.tasks import TaskManager

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache", raising=False)
    tasks = write_tasks(setup, tmp_path)
    out = lm_eval.simple_evaluate(
        model="slimwise",
        model_args=f"pretrained={setup['model']},plan={setup['plan']}",
        tasks=tasks,
        limit=4,
        task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
        bootstrap_iters=0,
        log_samples=True,
    )
    res = out["results"]
    assert 0.0 <= res["slimwise_testbed_gen"]["exact_match,final-answer"] <= 1.0
    assert 0.0 <= res["slimwise_testbed_mc"]["acc,none"] <= 1.0
    gen_samples = out["samples"]["slimwise_testbed_gen"]
    assert len(gen_samples) == 4 and all(isinstance(s["resps"][0][0], str) for s in gen_samples)
    mc_samples = out["samples"]["slimwise_testbed_mc"]
    assert all(len(s["resps"]) == 2 for s in mc_samples)  # one loglikelihood per choice


@pytest.mark.slow
def test_lm_eval_cli_through_module(setup, tmp_path):
    """The documented command line: python -m slimwise.evaluation.lm_eval_bridge (lm-eval's CLI, model
    registered)."""
    tasks = write_tasks(setup, tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "slimwise.evaluation.lm_eval_bridge",
            "run",
            "--model",
            "slimwise",
            "--model_args",
            f"pretrained={setup['model']},plan={setup['plan']}",
            "--tasks",
            tasks[1],
            "--include_path",
            str(tmp_path),
            "--limit",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "slimwise_testbed_mc" in proc.stdout and "acc" in proc.stdout
