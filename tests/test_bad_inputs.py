"""The bad-input corpus: every subcommand, fed what a careless or hostile user would give it, refuses with
exit 2 and one line on stderr (`slimwise...: error: ...`), writes nothing (no output, no hidden temporary
sibling) and leaves the source model byte for byte as it was.

The CLI runs in-process (`slimwise.cli.main`), so the whole corpus shares one tiny model and takes seconds.
`serve` and `bench` must refuse before any vLLM engine starts: starting one fails the test instead.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from lab.perf.cli import PROG as LAB_PROG
from lab.perf.cli import main as lab_main
from slimwise.cli import main

GARBAGE = bytes(range(256)) * 8 + b"\xff\xfe\x00\x80"


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """One tiny model (with tokenizer), its stats, a valid plan and export, and a shelf of broken inputs."""
    from tiny import save_tiny_model

    from lab.testbed.tokenizer import build_tokenizer
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.export import export_pruned
    from slimwise.models import load_model
    from slimwise.testbed import export_jsonl, make_split

    root = tmp_path_factory.mktemp("bad")
    model_dir = save_tiny_model("qwen3_moe", root / "model", initializer_range=0.15)
    build_tokenizer(model_dir)
    model = load_model(model_dir)
    stats = calibrate(model, [[5, 6, 7, 8], [9, 10, 11]],
                      config=CalibrationConfig(max_new_tokens=3), progress=False)
    stats.save(root / "stats.safetensors")
    plan = plan_from_stats(stats, "reap", 0.5)
    plan.save(root / "plan.json")
    export_pruned(model, plan, root / "pruned", source_dir=model_dir)
    export_jsonl(make_split("test", 1, seed=0), root / "data.jsonl")
    (root / "prompts.txt").write_text("1 + 2 =\n")
    (root / "afile").write_text("a regular file, not a directory\n")
    (root / "emptydir").mkdir()

    _other_weights(root, plan)
    _broken_checkpoints(root, model_dir)
    _broken_prompts(root)
    _broken_plans(root, plan)
    _broken_stats(root)
    return root


def _other_weights(root, plan) -> None:
    """The valid plan and export, made for other weights of the same configuration."""
    from tiny import save_tiny_model

    from slimwise.fingerprint import model_fingerprint
    from slimwise.models import load_model

    other = save_tiny_model("qwen3_moe", root / "other", seed=1, initializer_range=0.15)
    other_plan = plan.to_dict() | {"fingerprint": model_fingerprint(load_model(other))}
    (root / "plan-other-weights.json").write_text(json.dumps(other_plan))
    shutil.copytree(root / "pruned", root / "pruned-other")
    (root / "pruned-other" / "slimwise_plan.json").write_text(json.dumps(other_plan))


def _broken_checkpoints(root, model_dir) -> None:
    def broken(name: str, edit) -> None:
        shutil.copytree(model_dir, root / name)
        edit(root / name)

    weights = "model.safetensors"
    broken("truncated", lambda d: (d / weights).write_bytes(
        (d / weights).read_bytes()[: (d / weights).stat().st_size // 2]))
    broken("corrupt", lambda d: (d / weights).write_bytes(GARBAGE))
    broken("empty-weights", lambda d: (d / weights).write_bytes(b""))
    broken("header-only", lambda d: (d / weights).write_bytes((d / weights).read_bytes()[:4000]))
    broken("no-weights", lambda d: (d / weights).unlink())
    broken("config-malformed", lambda d: (d / "config.json").write_text('{"model_type": "qwen3_moe", '))
    broken("config-binary", lambda d: (d / "config.json").write_bytes(GARBAGE))
    broken("config-list", lambda d: (d / "config.json").write_text("[1, 2]"))
    broken("config-empty", lambda d: (d / "config.json").write_text(""))
    broken("config-no-type", lambda d: _edit_json(d / "config.json", drop="model_type"))
    broken("config-dense", lambda d: _edit_json(d / "config.json", model_type="llama"))
    broken("config-unknown", lambda d: _edit_json(d / "config.json", model_type="not_a_model"))
    broken("config-experts-str", lambda d: _edit_json(d / "config.json", num_experts="16"))
    broken("config-experts-wrong", lambda d: _edit_json(d / "config.json", num_experts=32))
    broken("config-topk-zero", lambda d: _edit_json(d / "config.json", num_experts_per_tok=0))
    broken("config-topk-huge", lambda d: _edit_json(d / "config.json", num_experts_per_tok=99))
    broken("config-hidden-wrong", lambda d: _edit_json(d / "config.json", hidden_size=48))
    # weights and config only, as a training state written out without its tokenizer: text prompts need one
    broken("no-tokenizer", lambda d: [(d / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json",
                                                                  "special_tokens_map.json")
                                      if (d / f).exists()])
    # quantized copies: block-wise FP8 (pruned from the files) and a format `prune` does not slice
    from quantized import fp8_checkpoint

    fp8_checkpoint(model_dir, root / "fp8", (32, 32))
    broken("gptq", lambda d: _edit_json(d / "config.json", quantization_config={"quant_method": "gptq",
                                                                                "bits": 4}))
    # a pruned checkpoint whose config contradicts its weights (llm-compressor 0.14 writes such configs)
    shutil.copytree(root / "pruned", root / "pruned-contradicts")
    _edit_json(root / "pruned-contradicts" / "config.json", num_experts=32, num_local_experts=64)
    shutil.copytree(root / "pruned", root / "pruned-truncated")
    w = root / "pruned-truncated" / weights
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 3])


def _broken_prompts(root) -> None:
    data = root / "data"
    data.mkdir()
    (data / "garbage.jsonl").write_bytes(GARBAGE)
    (data / "garbage.txt").write_bytes(GARBAGE)
    (data / "garbage").write_bytes(GARBAGE)
    (data / "utf16.jsonl").write_bytes('{"prompt": "1 + 2 ="}\n'.encode("utf-16"))
    (data / "empty.jsonl").write_text("")
    (data / "blank.jsonl").write_text("\n  \n\t\n")
    (data / "array.jsonl").write_text('["1 + 2 ="]\n')
    (data / "no-prompt.jsonl").write_text('{"answer": "3"}\n')
    (data / "prompt-number.jsonl").write_text('{"prompt": 12}\n')
    (data / "prompt-empty.jsonl").write_text('{"prompt": ""}\n')
    (data / "prompt-nan.jsonl").write_text('{"prompt": NaN}\n')
    (data / "half-line.jsonl").write_text('{"prompt": "1 + 2 ="}\n{"prompt": "3 +')
    (data / "garbage-dir").mkdir()
    (data / "garbage-dir" / "a.jsonl").write_bytes(GARBAGE)
    (data / "eval-no-answer.jsonl").write_text('{"prompt": "1 + 2 ="}\n')
    (data / "nul.jsonl").write_bytes(b'{"prompt": "a"}\n\x00\x00\x00\n')
    # continuations (calibrate --continuations): one line is too few for data.jsonl; the rest, 64 lines each
    (data / "cont-too-few.jsonl").write_text('{"token_ids": [5, 6]}\n')
    for name, ids in (("out-of-vocab", [10**9]), ("negative", [-1]), ("bool", [True]), ("empty-ids", []),
                      ("float", [5.0]), ("string", "5 6")):
        (data / f"cont-{name}.jsonl").write_text((json.dumps({"token_ids": ids}) + "\n") * 64)


def _broken_plans(root, plan) -> None:
    """Each a single defect of the valid plan."""
    good = plan.to_dict()
    layers = sorted(good["kept_experts"])
    first = layers[0]
    kept = good["kept_experts"][first]

    def with_layer(ids):
        return good | {"kept_experts": good["kept_experts"] | {first: ids}}

    plans = {
        "kept-list": good | {"kept_experts": [good["kept_experts"][k] for k in layers]},
        "id-abc": with_layer(["abc", *kept[1:]]),
        "num-experts-str": good | {"num_experts": "16"},
        "num-experts-bool": good | {"num_experts": True},
        "no-top-k": {k: v for k, v in good.items() if k != "top_k"},
        "no-kept": {k: v for k, v in good.items() if k != "kept_experts"},
        "no-family": {k: v for k, v in good.items() if k != "family"},
        "layer-x": good | {"kept_experts": {"x" if k == first else k: v
                                            for k, v in good["kept_experts"].items()}},
        "layer-negative": good | {"kept_experts": {"-1" if k == first else k: v
                                                   for k, v in good["kept_experts"].items()}},
        "layer-missing": good | {"kept_experts": {k: v
                                                  for k, v in good["kept_experts"].items() if k != first}},
        "layer-extra": good | {"kept_experts": good["kept_experts"] | {"99": kept}},
        "extra-key": good | {"surprise": 1},
        "duplicate-ids": with_layer([kept[0], *kept[:-1]]),
        "fractional-id": with_layer([1.5, *kept[1:]]),
        "id-out-of-range": with_layer([*kept[:-1], 16]),
        "id-negative": with_layer([-1, *kept[1:]]),
        "id-bool": with_layer([True, *kept[1:]]),
        "ids-null": with_layer(None),
        "ids-nested": with_layer([kept]),
        "fewer-than-top-k": with_layer(kept[:3]),
        "kept-empty": good | {"kept_experts": {}},
        "top-k-zero": good | {"top_k": 0},
        "top-k-above-experts": good | {"top_k": 17},
        "ratio-one": good | {"ratio": 1.0},
        "ratio-negative": good | {"ratio": -0.5},
        "ratio-str": good | {"ratio": "0.5"},
        "scope-bogus": good | {"scope": "everywhere"},
        "groups-not-dividing": good | {"num_groups": 3},
        "fingerprint-number": good | {"fingerprint": {"config_sha256": 1, "weights_sha256": 2}},
        "wrong-format": good | {"format": "slimwise-plan/0"},
        "other-family": good | {"family": "mixtral"},
        "other-expert-count": good | {"num_experts": 32},
        "other-top-k": good | {"top_k": 2},
    }
    pdir = root / "plans"
    pdir.mkdir()
    for name, d in plans.items():
        (pdir / f"{name}.json").write_text(json.dumps(d))
    (pdir / "ratio-nan.json").write_text(json.dumps(good | {"ratio": float("nan")}))  # json writes NaN
    (pdir / "ratio-inf.json").write_text(json.dumps(good | {"ratio": float("inf")}))
    (pdir / "not-json.json").write_text("{kept_experts: 1")
    (pdir / "array.json").write_text("[]")
    (pdir / "empty.json").write_text("")
    (pdir / "binary.json").write_bytes(GARBAGE)
    (pdir / "a-stats-file.json").write_bytes((root / "stats.safetensors").read_bytes())


def _broken_stats(root) -> None:
    """Statistics and bench files that are not what they claim."""
    (root / "stats-garbage.safetensors").write_bytes(GARBAGE)
    (root / "stats-empty.safetensors").write_bytes(b"")
    (root / "stats-truncated.safetensors").write_bytes((root / "stats.safetensors").read_bytes()[:200])
    (root / "bench-garbage.json").write_bytes(GARBAGE)
    (root / "bench-list.json").write_text("[]")


def _edit_json(path: Path, drop: str | None = None, **changes) -> None:
    d = json.loads(path.read_text())
    if drop:
        d.pop(drop)
    d.update(changes)
    path.write_text(json.dumps(d))


@pytest.fixture(autouse=True)
def no_engines(monkeypatch):
    """A case that gets as far as starting vLLM (serve, bench) fails instead of starting it."""
    import slimwise.perf.bench as bench
    import slimwise.serving.server as server

    def refuse(*_a, **_k):
        raise AssertionError("an engine would start: the bad input was not refused before start-up")

    monkeypatch.setattr(server.Supervisor, "start", refuse)
    monkeypatch.setattr(server, "_decode_checkpoint", refuse)
    monkeypatch.setattr(bench, "make_variants", refuse)


M, P, D = "{root}/model", "{root}/plan.json", "{root}/data.jsonl"
OUT = "{root}/runs/{case}/result"  # every case writes (if anything) here, unless it names another output
IN_FILE = "{root}/afile/result"  # under a regular file: unwritable even for root
IN_PROC = "/proc/slimwise-bad-input/result"  # procfs: no new files, even for root

BROKEN_MODELS = ["truncated", "corrupt", "empty-weights", "header-only", "no-weights", "config-malformed",
                 "config-binary", "config-list", "config-empty", "config-no-type", "config-dense",
                 "config-unknown", "config-experts-str", "config-experts-wrong", "config-topk-zero",
                 "config-topk-huge", "config-hidden-wrong", "emptydir", "afile", "missing"]
BAD_PROMPTS = ["garbage.jsonl", "garbage.txt", "garbage", "utf16.jsonl", "empty.jsonl", "blank.jsonl",
               "array.jsonl", "no-prompt.jsonl", "prompt-number.jsonl", "prompt-empty.jsonl",
               "prompt-nan.jsonl", "half-line.jsonl", "garbage-dir", "nul.jsonl", "missing.jsonl"]
BAD_PLANS = ["kept-list", "id-abc", "num-experts-str", "num-experts-bool", "no-top-k", "no-kept", "no-family",
             "layer-x", "layer-negative", "layer-missing", "layer-extra", "extra-key", "duplicate-ids",
             "fractional-id", "id-out-of-range", "id-negative", "id-bool", "ids-null", "ids-nested",
             "fewer-than-top-k", "kept-empty", "top-k-zero", "top-k-above-experts", "ratio-one",
             "ratio-negative", "ratio-str", "ratio-nan", "ratio-inf", "scope-bogus", "groups-not-dividing",
             "fingerprint-number", "wrong-format", "other-family", "other-expert-count", "other-top-k",
             "other-weights", "not-json", "array", "empty", "binary", "a-stats-file", "missing"]


def _plan(name: str) -> str:
    return "{root}/plan-other-weights.json" if name == "other-weights" else f"{{root}}/plans/{name}.json"


CASES: dict[str, tuple[list[str], str | None]] = {}
#: Cases whose one line must say this (another refusal would hide the real cause: a directory without
#: tokenizer files once loaded as a one-token tokenizer, and text prompts were refused as empty).
SAYS: dict[str, str] = {"calibrate-model-no-tokenizer": "need a tokenizer",
                        "eval-model-no-tokenizer": "need a tokenizer"}


def case(name: str, argv: list[str], out: str | None = OUT) -> None:
    assert name not in CASES, name
    CASES[name] = (argv, out)


# ----- calibrate --------------------------------------------------------------------------------------------
CAL = ["calibrate", M, "--data", D, "--max-new-tokens", "2"]
for m in BROKEN_MODELS:
    case(f"calibrate-model-{m}", ["calibrate", f"{{root}}/{m}", "--data", D, "--out", OUT])
for f in BAD_PROMPTS:
    case(f"calibrate-prompts-{f}", ["calibrate", M, "--data", f"{{root}}/data/{f}", "--out", OUT])
for opt, value in [("--batch-size", "0"), ("--batch-size", "-3"), ("--batch-size", "two"),
                   ("--max-new-tokens", "0"), ("--max-new-tokens", "-1"), ("--max-samples", "0"),
                   ("--seed", "-1"), ("--phase", "both"), ("--dtype", "int8")]:
    case(f"calibrate-{opt[2:]}-{value}", [*CAL, opt, value, "--out", OUT])
case("calibrate-out-under-file", [*CAL, "--out", IN_FILE], IN_FILE)
case("calibrate-out-on-proc", [*CAL, "--out", IN_PROC], IN_PROC)
case("calibrate-out-is-dir", [*CAL, "--out", "{root}/emptydir"], "{root}/emptydir")
case("calibrate-no-out", [*CAL], None)
case("calibrate-unknown-option", [*CAL, "--out", OUT, "--frobnicate"])
for f in [*BAD_PROMPTS, "cont-too-few.jsonl", "cont-out-of-vocab.jsonl", "cont-negative.jsonl",
          "cont-bool.jsonl", "cont-empty-ids.jsonl", "cont-float.jsonl", "cont-string.jsonl"]:
    case(f"calibrate-continuations-{f}", [*CAL, "--continuations", f"{{root}}/data/{f}", "--out", OUT])
case("calibrate-model-no-tokenizer", ["calibrate", "{root}/no-tokenizer", "--data", D, "--out", OUT])
case("calibrate-continuations-and-vllm", [*CAL, "--engine", "vllm", "--continuations", D, "--out", OUT])

# ----- plan -------------------------------------------------------------------------------------------------
PLAN = ["plan", "--stats", "{root}/stats.safetensors"]
for ratio in ("1", "1.5", "-0.1", "nan", "inf", "half"):
    case(f"plan-ratio-{ratio}", [*PLAN, "--ratio", ratio, "--out", OUT])
case("plan-ratio-below-top-k", [*PLAN, "--ratio", "0.9", "--out", OUT])
case("plan-criterion-unknown", [*PLAN, "--criterion", "vibes", "--out", OUT])
for s in ("garbage", "empty", "truncated"):
    case(f"plan-stats-{s}", ["plan", "--stats", f"{{root}}/stats-{s}.safetensors", "--out", OUT])
case("plan-stats-missing", ["plan", "--stats", "{root}/nope.safetensors", "--out", OUT])
case("plan-stats-is-plan", ["plan", "--stats", P, "--out", OUT])
case("plan-stats-is-dir", ["plan", "--stats", "{root}/emptydir", "--out", OUT])
case("plan-no-stats", ["plan", "--out", OUT])
case("plan-out-is-dir", [*PLAN, "--out", "{root}/emptydir"], "{root}/emptydir")
case("plan-out-under-file", [*PLAN, "--out", IN_FILE], IN_FILE)
case("plan-out-on-proc", [*PLAN, "--out", IN_PROC], IN_PROC)
case("plan-ratios-one-bad", [*PLAN, "--ratio", "0.25", "1", "--nested", "--out", OUT])
case("plan-nested-below-top-k", [*PLAN, "--ratio", "0.25", "0.9", "--nested", "--out", OUT])
case("plan-ratios-no-stats", ["plan", "--ratio", "0.25", "0.5", "--out", OUT])
case("plan-budget-no-data", [*PLAN, "--budget-model", M, "--out", OUT])
case("plan-budget-global", [*PLAN, "--budget-model", M, "--budget-data", "{root}/prompts.txt", "--global",
                            "--out", OUT])
case("plan-budget-other-model", [*PLAN, "--budget-model", "{root}/pruned", "--budget-data",
                                 "{root}/prompts.txt", "--out", OUT])
case("plan-budget-data-garbage", [*PLAN, "--budget-model", M, "--budget-data", "{root}/data/garbage.jsonl",
                                  "--out", OUT])
case("plan-ratios-out-is-file", [*PLAN, "--ratio", "0.25", "0.5", "--out", "{root}/afile"], "{root}/afile")
case("plan-ratios-out-under-file", [*PLAN, "--ratio", "0.25", "0.5", "--out", IN_FILE], IN_FILE)
case("plan-nested-out-on-proc", [*PLAN, "--nested", "--out", IN_PROC], IN_PROC)

# ----- prune ------------------------------------------------------------------------------------------------
for p in BAD_PLANS:
    case(f"prune-plan-{p}", ["prune", M, "--plan", _plan(p), "--out", OUT])
for m in ("truncated", "corrupt", "config-malformed", "config-dense", "missing", "emptydir"):
    case(f"prune-model-{m}", ["prune", f"{{root}}/{m}", "--plan", P, "--out", OUT])
case("prune-out-under-file", ["prune", M, "--plan", P, "--out", IN_FILE], IN_FILE)
case("prune-out-on-proc", ["prune", M, "--plan", P, "--out", IN_PROC], IN_PROC)
case("prune-out-inside-source", ["prune", M, "--plan", P, "--out", "{root}/model/pruned"],
     "{root}/model/pruned")
case("prune-out-is-file", ["prune", M, "--plan", P, "--out", "{root}/afile"], "{root}/afile")
case("prune-ratio-nan", ["prune", M, "--stats", "{root}/stats.safetensors", "--ratio", "nan", "--out", OUT])
case("prune-distilled-missing", ["prune", M, "--plan", P, "--distilled", "{root}/nope", "--out", OUT])
case("prune-distilled-not-a-delta", ["prune", M, "--plan", P, "--distilled", "{root}/emptydir", "--out", OUT])
case("prune-quantized-dtype", ["prune", "{root}/fp8", "--plan", P, "--dtype", "float32", "--out", OUT])
case("prune-quantized-distilled", ["prune", "{root}/fp8", "--plan", P, "--distilled", "{root}/emptydir",
                                   "--out", OUT])
case("prune-quantized-other-weights", ["prune", "{root}/fp8", "--plan", P, "--out", OUT])
case("prune-quantized-unsupported", ["prune", "{root}/gptq", "--plan", P, "--out", OUT])

# ----- generate ---------------------------------------------------------------------------------------------
GEN = ["generate", M, "--prompts", "{root}/prompts.txt", "--max-new-tokens", "2"]
for p in ("id-abc", "duplicate-ids", "fractional-id", "fewer-than-top-k", "layer-missing", "layer-extra",
          "ratio-nan", "other-weights", "other-top-k", "kept-list", "no-top-k", "binary", "missing"):
    case(f"generate-plan-{p}", [*GEN, "--plan", _plan(p), "--out", OUT])
for f in ("garbage.jsonl", "garbage.txt", "garbage", "utf16.jsonl", "empty.jsonl",
          "no-prompt.jsonl", "missing.jsonl"):
    case(f"generate-prompts-{f}",
         ["generate", M, "--plan", P, "--prompts", f"{{root}}/data/{f}", "--out", OUT])
for m in ("truncated", "corrupt", "config-malformed", "config-experts-wrong", "missing", "afile"):
    case(f"generate-model-{m}", ["generate", f"{{root}}/{m}", "--plan", P, "--prompts", "{root}/prompts.txt",
                                 "--out", OUT])
for opt, value in [("--max-new-tokens", "-1"), ("--max-new-tokens", "0"), ("--temperature", "-1"),
                   ("--temperature", "nan"), ("--top-p", "5"), ("--top-p", "0"), ("--top-k", "-2"),
                   ("--batch-size", "0"), ("--seed", "-5"), ("--mode", "turbo")]:
    case(f"generate-{opt[2:]}-{value}", [*GEN, "--plan", P, opt, value, "--out", OUT])
case("generate-no-plan", [*GEN, "--mode", "slimwise", "--out", OUT])
for opt, value in [("--fallback", "1.5"), ("--fallback", "-0.1"), ("--fallback", "nan"), ("--gates", "half")]:
    case(f"generate-{opt[2:]}-{value}", [*GEN, "--plan", P, opt, value, "--out", OUT])
case("generate-fallback-no-plan", [*GEN, "--mode", "full", "--fallback", "0.5", "--out", OUT])
# batch budgets: out of range, two at once, with another gate variant, below top-k, outside slimwise mode
for opt, value in [("--budget", "0"), ("--budget", "x"), ("--budget-share", "0"), ("--budget-share", "1.5"),
                   ("--extra", "-1")]:
    case(f"generate-{opt[2:]}-{value}", [*GEN, "--plan", P, opt, value, "--out", OUT])
case("generate-budget-and-extra", [*GEN, "--plan", P, "--budget", "4", "--extra", "1", "--out", OUT])
case("generate-budget-drop", [*GEN, "--plan", P, "--budget", "4", "--gates", "drop", "--out", OUT])
case("generate-budget-below-top-k", [*GEN, "--plan", P, "--budget", "1", "--out", OUT])
case("generate-budget-uniform", [*GEN, "--plan", P, "--mode", "uniform", "--extra", "1", "--out", OUT])
case("generate-budget-decode-model", [*GEN, "--decode-model", "{root}/model", "--budget", "4", "--out", OUT])
case("generate-substitute-no-stats", [*GEN, "--plan", P, "--gates", "substitute", "--out", OUT])
case("generate-substitutes-without-gates",
     [*GEN, "--plan", P, "--substitutes", "{root}/stats.safetensors", "--out", OUT])
case("generate-substitutes-no-output-sums",
     [*GEN, "--plan", P, "--gates", "substitute", "--substitutes", "{root}/stats.safetensors", "--out", OUT])
case("generate-substitutes-garbage",
     [*GEN, "--plan", P, "--gates", "substitute", "--substitutes", "{root}/stats-garbage.safetensors",
      "--out", OUT])
case("generate-gates-decode-model",
     [*GEN, "--decode-model", "{root}/pruned", "--gates", "drop", "--out", OUT])
case("generate-decode-model-contradicts", [*GEN, "--decode-model", "{root}/pruned-contradicts", "--out", OUT])
case("generate-decode-model-truncated", [*GEN, "--decode-model", "{root}/pruned-truncated", "--out", OUT])
case("generate-decode-model-other-plan", [*GEN, "--decode-model", "{root}/pruned",
                                          "--plan", "{root}/plan-other-weights.json", "--out", OUT])
case("generate-decode-model-other-weights", [*GEN, "--decode-model", "{root}/pruned-other", "--out", OUT])
case("generate-decode-model-missing", [*GEN, "--decode-model", "{root}/nope", "--out", OUT])
case("generate-out-under-file", [*GEN, "--plan", P, "--out", IN_FILE], IN_FILE)
case("generate-out-on-proc", [*GEN, "--plan", P, "--out", IN_PROC], IN_PROC)
case("generate-out-is-dir", [*GEN, "--plan", P, "--out", "{root}/emptydir"], "{root}/emptydir")

# ----- eval (its output is a directory: nothing may be left there) ------------------------------------------
EVAL = ["eval", M, "--max-samples", "2", "--max-new-tokens", "2", "--no-plots", "--no-kl", "--no-traffic"]
case("eval-model-missing", ["eval", "{root}/nope", "--out", OUT])
case("eval-fallback-out-of-range", [*EVAL, "--plan", P, "--fallback", "1.01", "--out", OUT])
case("eval-budget-and-budget-share", [*EVAL, "--plan", P, "--budget", "4", "--budget-share", "0.5", "--out",
                                      OUT])
case("eval-gates-unknown", [*EVAL, "--plan", P, "--gates", "keep", "--out", OUT])
case("eval-model-truncated", ["eval", "{root}/truncated", "--plan", P, "--out", OUT])
case("eval-model-no-tokenizer", ["eval", "{root}/no-tokenizer", "--max-samples", "2", "--max-new-tokens", "2",
                                  "--no-plots", "--no-kl", "--no-traffic", "--plan", P, "--out", OUT])
case("eval-model-config-malformed", ["eval", "{root}/config-malformed", "--plan", P, "--out", OUT])
for f in ("garbage.jsonl", "garbage", "utf16.jsonl", "empty.jsonl", "eval-no-answer.jsonl", "missing.jsonl"):
    case(f"eval-data-{f}", [*EVAL, "--plan", P, "--data", f"{{root}}/data/{f}", "--out", OUT])
case("eval-calib-data-garbage", [*EVAL, "--calib-data", "{root}/data/garbage.jsonl", "--out", OUT])
for p in ("duplicate-ids", "fractional-id", "fewer-than-top-k", "ratio-nan", "other-weights", "layer-missing",
          "binary"):
    case(f"eval-plan-{p}", [*EVAL, "--plan", _plan(p), "--out", OUT])
for opt, value in [("--ratios", "nan"), ("--ratios", "1.5"), ("--ratios", "x"), ("--criteria", "vibes"),
                   ("--phases", "later"), ("--modes", "turbo"), ("--batch-size", "0"), ("--per-family", "0"),
                   ("--grader", "nonsense")]:
    case(f"eval-{opt[2:]}-{value}", [*EVAL, opt, value, "--out", OUT])
case("eval-stats-garbage", [*EVAL, "--stats", "{root}/stats-garbage.safetensors", "--out", OUT])
case("eval-out-under-file", [*EVAL, "--plan", P, "--out", IN_FILE], IN_FILE)
# a traffic mix (--route): refused before any engine starts
case("eval-route-without-vllm", [*EVAL, "--plan", "m=" + P, "--route", "arithmetic=m", "--out", OUT])
case("eval-route-unnamed-plan",
     [*EVAL, "--engine", "vllm", "--plan", P, "--route", "arithmetic=m", "--out", OUT])
case("eval-route-unknown-plan", [*EVAL, "--engine", "vllm", "--plan", "m=" + P, "--route", "arithmetic=x",
                                 "--out", OUT])
case("eval-route-malformed",
     [*EVAL, "--engine", "vllm", "--plan", "m=" + P, "--route", "arithmetic", "--out", OUT])
case("eval-route-plan-for-other-model", [*EVAL, "--engine", "vllm", "--plan", "m=" + _plan("layer-extra"),
                                         "--route", "arithmetic=m", "--out", OUT])

# ----- distill ----------------------------------------------------------------------------------------------
DIS = ["distill", M, "--data", D, "--steps", "1"]
for p in ("duplicate-ids", "fractional-id", "other-weights", "layer-missing", "binary", "missing"):
    case(f"distill-plan-{p}", [*DIS, "--plan", _plan(p), "--out", OUT])
for f in ("garbage.jsonl", "empty.jsonl", "missing.jsonl"):
    case(f"distill-data-{f}", ["distill", M, "--plan", P, "--data", f"{{root}}/data/{f}", "--out", OUT])
case("distill-model-truncated", ["distill", "{root}/truncated", "--plan", P, "--data", D, "--out", OUT])
for opt, value in [("--steps", "0"), ("--lr", "0"), ("--lr", "nan"), ("--batch-size", "0"),
                   ("--on-policy", "2"), ("--loss", "mse"), ("--params", "router,everything"),
                   ("--lora-rank", "0")]:
    case(f"distill-{opt[2:]}-{value}", [*DIS, "--plan", P, opt, value, "--out", OUT])
case("distill-teacher-garbage", [*DIS, "--plan", P, "--teacher", "{root}/bench-garbage.json", "--out", OUT])
case("distill-out-under-file", [*DIS, "--plan", P, "--out", IN_FILE], IN_FILE)
case("distill-out-inside-source", [*DIS, "--plan", P, "--out", "{root}/model/delta"], "{root}/model/delta")

# ----- serve: refused in the preflight, before any engine ---------------------------------------------------
for m in ("missing", "emptydir", "afile", "config-malformed", "config-dense"):
    case(f"serve-model-{m}", ["serve", f"{{root}}/{m}", "--plan", P], None)
case("serve-embedded-with-bad-plan", ["serve", "testbed-a", "--plan", _plan("duplicate-ids")], None)
case("serve-embedded-with-plan-for-other-model", ["serve", "testbed-a", "--plan", P], None)
for p in ("other-weights", "fewer-than-top-k", "layer-missing", "layer-extra", "fractional-id", "other-top-k",
          "binary", "missing"):
    case(f"serve-plan-{p}", ["serve", M, "--plan", _plan(p)], None)
for opt, value in [("--port", "99999"), ("--port", "0"), ("--port", "http"), ("--min-decode-batch", "-1"),
                   ("--log-every", "-1")]:
    case(f"serve-{opt[2:]}-{value}", ["serve", M, "--plan", P, opt, value], None)
case("serve-disaggregated-no-plan", ["serve", M, "--disaggregated"], None)
case("serve-fallback-disaggregated", ["serve", M, "--plan", P, "--disaggregated", "--fallback", "0.5"], None)
case("serve-gates-no-plan", ["serve", M, "--gates", "drop"], None)
case("serve-budget-disaggregated", ["serve", M, "--plan", P, "--disaggregated", "--budget-share", "0.5"],
     None)
case("serve-budget-no-plan", ["serve", M, "--extra", "2"], None)
case("serve-budget-below-top-k", ["serve", M, "--plan", P, "--budget", "1"], None)
case("serve-budget-distilled", ["serve", M, "--plan", P, "--budget", "4", "--distilled", "{root}/emptydir"],
     None)
case("serve-gates-over-running-instances", ["serve", M, "--plan", P, "--disaggregated", "--gates", "drop",
                                            "--prefill-url", "http://127.0.0.1:9", "--decode-url",
                                            "http://127.0.0.1:9"], None)
case("serve-gates-disaggregated-hf-overrides", ["serve", M, "--plan", P, "--disaggregated", "--gates", "drop",
                                                "--hf-overrides", "{{}}"], None)
case("serve-substitutes-no-output-sums",
     ["serve", M, "--plan", P, "--gates", "substitute", "--substitutes", "{root}/stats.safetensors"], None)
case("serve-fallback-out-of-range", ["serve", M, "--plan", P, "--fallback", "2"], None)
case("serve-decode-model-other-weights", ["serve", M, "--plan", P, "--disaggregated",
                                          "--decode-model", "{root}/pruned-other"], None)
case("serve-kv-dir-max-gb-negative",
     ["serve", M, "--plan", P, "--disaggregated", "--kv-dir-max-gb", "-1"], None)
# several plans in one engine (--plan NAME=PLAN)
case("serve-plans-unnamed-twice", ["serve", M, "--plan", P, "--plan", P], None)
case("serve-plans-named-and-unnamed", ["serve", M, "--plan", "a=" + P, "--plan", P], None)
case("serve-plans-name-twice", ["serve", M, "--plan", "a=" + P, "--plan", "a=" + P], None)
case("serve-plans-name-full", ["serve", M, "--plan", "full=" + P], None)
case("serve-plans-name-with-colon", ["serve", M, "--plan", "a:b=" + P], None)
case("serve-plans-default-unknown", ["serve", M, "--plan", "a=" + P, "--default-plan", "b"], None)
case("serve-plans-default-without-names", ["serve", M, "--plan", P, "--default-plan", "full"], None)
case("serve-plans-disaggregated",
     ["serve", M, "--plan", "a=" + P, "--plan", "b=" + P, "--disaggregated"], None)
case("serve-plans-one-for-other-weights",
     ["serve", M, "--plan", "a=" + P, "--plan", "b=" + _plan("other-weights")], None)

#: the lab's perf studies (`python -m lab.perf.cli`): their cases run through its main, with the same contract
LAB_COMMANDS = {"roofline", "calib-cost", "policy-quality"}

# ----- roofline ---------------------------------------------------------------------------------------------
for opt, value in [("--ratio", "1"), ("--ratio", "nan"), ("--batch", "0"), ("--context", "0"),
                   ("--layers", "0"), ("--overhead-us", "-1"), ("--reference", "0"), ("--hardware", "abacus"),
                   ("--preset", "gpt-9")]:
    case(f"roofline-{opt[2:]}-{value}", ["roofline", "--preset", "cpu", opt, value] if opt != "--preset"
         else ["roofline", opt, value], None)
case("roofline-config-garbage", ["roofline", "--config", "{root}/bench-garbage.json"], None)
case("roofline-config-list", ["roofline", "--config", "{root}/bench-list.json"], None)
case("roofline-config-missing", ["roofline", "--config", "{root}/nope.json"], None)
case("roofline-config-dense", ["roofline", "--config", "{root}/config-dense"], None)
case("roofline-config-malformed-dir", ["roofline", "--config", "{root}/config-malformed"], None)
case("roofline-stats-garbage", ["roofline", "--preset", "cpu", "--stats", "{root}/stats-garbage.safetensors",
                                "--out", OUT])
case("roofline-out-under-file", ["roofline", "--preset", "cpu", "--out", IN_FILE], IN_FILE)

# ----- bench (never reaches vLLM) ---------------------------------------------------------------------------
BENCH = ["bench", M, "--out", OUT]
for opt, value in [("--batch", "0"), ("--ratio", "1"), ("--output-len", "1"), ("--repetitions", "0"),
                   ("--kv-cache-gb", "0"), ("--synthetic", "gpt-9"), ("--top-k", "0")]:
    case(f"bench-{opt[2:]}-{value}", [*BENCH, opt, value])
case("bench-synthetic-top-k-above-experts", ["bench", "--synthetic", "smoke", "--top-k", "17",
                                             "--synthetic-dir", "{root}/synthetic-k17", "--out", OUT])
case("bench-variants-unknown", [*BENCH, "--variants", "full", "warp"])
case("bench-variants-without-full", [*BENCH, "--variants", "slimwise"])
case("bench-gated-without-gates", [*BENCH, "--variants", "full", "gated"])
case("bench-fallback-without-gated", [*BENCH, "--variants", "full", "slimwise", "--fallback", "0.5"])
case("bench-model-missing", ["bench", "{root}/nope", "--out", OUT])
case("bench-model-and-synthetic", [*BENCH, "--synthetic", "cpu"])
for p in ("duplicate-ids", "binary", "fractional-id", "layer-missing", "other-weights"):
    case(f"bench-plan-{p}", [*BENCH, "--plan", _plan(p)])  # the export loads the model: weights checked too
for p in ("layer-missing", "layer-extra", "other-top-k", "other-expert-count"):  # no export: checked on meta
    case(f"bench-plan-{p}-masked-only", [*BENCH, "--plan", _plan(p), "--variants", "full", "slimwise"])
case("bench-from-json-garbage", ["bench", "--from-json", "{root}/bench-garbage.json"], None)
case("bench-from-json-list", ["bench", "--from-json", "{root}/bench-list.json"], None)
case("bench-from-json-missing", ["bench", "--from-json", "{root}/nope.json"], None)

# ----- calib-cost, demo, the top level ----------------------------------------------------------------------
for opt, value in [("--batch-size", "0"), ("--num-prompts", "0"), ("--repetitions", "0"),
                   ("--phase", "later")]:
    case(f"calib-cost-{opt[2:]}-{value}", ["calib-cost", M, opt, value, "--out", OUT])
for m in ("missing", "truncated", "config-dense"):
    case(f"calib-cost-model-{m}", ["calib-cost", f"{{root}}/{m}", "--out", OUT])
case("calib-cost-no-model", ["calib-cost", "--out", OUT])
for opt, value in [("--samples", "0"), ("--samples", "-1"), ("--seed", "x")]:
    case(f"demo-{opt[2:]}-{value}", ["demo", opt, value, "--out", OUT])
case("demo-out-under-file", ["demo", "--out", IN_FILE], IN_FILE)
for opt, value in [("--threshold", "0"), ("--concurrency", "0"), ("--ratio", "nan"),
                   ("--n-per-family", "-1")]:
    case(f"policy-quality-{opt[2:]}-{value}",
         ["policy-quality", M, "--threshold", "4", opt, value, "--out", OUT])
case("no-command", [], None)
case("unknown-command", ["frobnicate"], None)


def _fill(text: str, root: Path, name: str) -> str:
    return text.format(root=root, case=name)


# known gaps, kept in the corpus so that closing one shows (strict: an unexpected pass fails)
KNOWN_GAPS: dict[str, str] = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_GAPS[n], strict=True))
                                  if n in KNOWN_GAPS else n for n in sorted(CASES)])
def test_bad_input_refused(env, name, capsys):
    argv, out = CASES[name]
    argv, out = [_fill(a, env, name) for a in argv], Path(_fill(out, env, name)) if out else None
    model_before = snapshot(env / "model")
    existed = out is not None and out.exists()
    out_before = (snapshot(out) if out.is_dir() else out.read_bytes()) if existed else None
    parent_before = sorted(p.name for p in out.parent.iterdir()) \
        if out is not None and out.parent.is_dir() else None
    capsys.readouterr()
    try:
        code = (lab_main if argv and argv[0] in LAB_COMMANDS else main)(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, f"exit {code}, stderr: {err[-600:]!r}"
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line: {err[-600:]!r}"
    assert lines[0].startswith(("slimwise", LAB_PROG)) and ": error: " in lines[0], lines[0]
    assert SAYS.get(name, "") in lines[0], lines[0]
    assert "Traceback" not in err
    assert snapshot(env / "model") == model_before, "the source model was modified"
    if out is not None:
        if existed:
            assert (snapshot(out) if out.is_dir() else out.read_bytes()) == out_before, f"{out} was modified"
        else:
            assert not out.exists(), f"{out} was written"
        if parent_before is not None:
            assert sorted(p.name for p in out.parent.iterdir()) == parent_before, "a sibling was left behind"
        else:  # the output's directory did not exist: it must not exist now either
            assert not out.parent.exists() or out.parent == env / "afile", f"{out.parent} was created"
        assert not list(out.parent.glob(f".{out.name}.*")) if out.parent.is_dir() else True


def test_the_corpus_is_large_and_covers_every_subcommand():
    assert len(CASES) >= 120
    from lab.perf.cli import build_parser as lab_parser
    from slimwise.cli import build_parser

    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(lab_parser()._subparsers._group_actions[0].choices) == LAB_COMMANDS
    commands |= LAB_COMMANDS
    covered = {argv[0] for argv, _ in CASES.values() if argv}
    assert commands <= covered, f"subcommands without a bad-input case: {sorted(commands - covered)}"


def test_a_refusal_after_the_weights_load_is_one_line_in_a_real_process(env):
    """The one subprocess of the corpus: stderr piped as in logs and CI (transformers' loading bar
    and import-time warnings would show here, not under capsys), with a refusal that comes only
    once the checkpoint's files are read (their checksum against the plan's)."""
    import subprocess
    import sys

    out = env / "runs" / "subprocess" / "pruned"
    proc = subprocess.run([sys.executable, "-m", "slimwise.cli", "prune", str(env / "model"), "--plan",
                           str(env / "plan-other-weights.json"), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("slimwise: error: plan fingerprint"), \
        proc.stderr
    assert not out.parent.exists()


def test_kill_9_of_prune_mid_write_leaves_no_target_and_the_next_run_cleans_up(env):
    """kill -9 of a real `slimwise prune` while it writes: no partial target, and the next run
    removes the dead process's temporary. The kill lands when the temporary directory appears (polled
    every millisecond); a run that finishes first is retried with a new output, and at least one of
    ten must be killed mid-write."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = env / "runs" / "kill9"
    root.mkdir(parents=True, exist_ok=True)
    for attempt in range(10):
        out = root / f"pruned-{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "slimwise.cli", "prune", str(env / "model"), "--plan",
                                 str(env / "plan.json"), "--out", str(out)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        tmp = root / f".{out.name}.tmp-{proc.pid}"
        deadline = time.monotonic() + 300
        while proc.poll() is None and not tmp.exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        if proc.poll() is None and tmp.exists():
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        proc.wait()
    else:
        pytest.fail("prune finished before its temporary directory was seen in 10 runs")
    # killed mid-write: nothing under the real name, a stale temporary
    assert not out.exists() and tmp.exists()
    again = subprocess.run([sys.executable, "-m", "slimwise.cli", "prune", str(env / "model"), "--plan",
                            str(env / "plan.json"), "--out", str(out)], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert (out / "config.json").is_file() and not tmp.exists()
    assert not [p.name for p in root.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
