"""The `slimwise` command line: the full core flow and its error handling.

Each test runs its first command as a real process (`python -m slimwise.cli`: exit code, stdout and stderr as
a user sees them) and the rest in this process through `slimwise.cli.main`, the same entry point without the
9-11 s of importing torch and transformers again per command (measured on a 2-core AVX2-only VM: these three
tests took 153 s as eight plus four plus four processes).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from tiny import save_tiny_model

from slimwise.testbed import build_tokenizer, export_jsonl, make_split

SLIMWISE = [sys.executable, "-m", "slimwise.cli"]


def run(*args, check=True):
    proc = subprocess.run([*SLIMWISE, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"slimwise {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def call(capsys, *args, check=True) -> subprocess.CompletedProcess:
    """`run` in this process: `slimwise.cli.main`, whose return value (or argparse's
    SystemExit) is the exit code."""
    from slimwise.cli import main

    capsys.readouterr()
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    proc = subprocess.CompletedProcess(["slimwise", *map(str, args)], code, out.out, out.err)
    if check and code != 0:
        raise AssertionError(f"slimwise {' '.join(map(str, args))} failed:\n{out.out}\n{out.err}")
    return proc


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model("qwen3_moe", root / "model", initializer_range=0.15)
    build_tokenizer(model)
    export_jsonl(make_split("calib", 2, seed=0), root / "calib.jsonl")
    export_jsonl(make_split("test", 1, seed=0), root / "test.jsonl")
    return root


def test_help_lists_subcommands():
    out = run("--help").stdout
    for name in ("calibrate", "plan", "prune", "generate", "demo"):
        assert name in out


def test_core_flow(workdir, capsys):
    model, stats, plan, pruned = (workdir / n for n in ("model", "stats.safetensors", "plan.json", "pruned"))
    out = run("calibrate", model, "--data", workdir / "calib.jsonl", "--phase", "decode", "--out", stats,
              "--max-new-tokens", "8", "--output-sums")
    assert "MoE layers" in out.stdout and stats.is_file()
    call(capsys, "plan", "--stats", stats, "--criterion", "reap", "--ratio", "0.5", "--out", plan)
    saved = json.loads(plan.read_text())
    assert saved["criterion"] == "reap" and saved["phase"] == "decode"
    assert all(len(v) == 8 for v in saved["kept_experts"].values())
    call(capsys, "prune", model, "--plan", plan, "--out", pruned)
    assert json.loads((pruned / "config.json").read_text())["num_experts"] == 8
    assert (pruned / "tokenizer.json").is_file() and (pruned / "slimwise_plan.json").is_file()

    results = {}
    for mode, extra in (("full", []), ("slimwise", ["--plan", plan]), ("uniform", ["--plan", plan]),
                        ("slimwise-sliced", ["--decode-model", pruned])):
        out_file = workdir / f"{mode}.jsonl"
        call(capsys, "generate", model, "--mode", mode.split("-")[0], "--prompts", workdir / "test.jsonl",
            "--max-new-tokens", "10", "--out", out_file, *extra)
        results[mode] = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert len(results["full"]) == 13
    assert [r["token_ids"] for r in results["slimwise"]] \
        == [r["token_ids"] for r in results["slimwise-sliced"]]
    assert [r["token_ids"][0] for r in results["slimwise"]] == [r["token_ids"][0] for r in results["full"]]
    assert all(isinstance(r["text"], str) for r in results["full"])

    # the fallback dial's ends: tau = 0 under drop is the full model, tau = 1 the variant alone
    for name, extra in (("dial-0", ["--gates", "drop", "--fallback", "0"]), ("dial-1", ["--fallback", "1"]),
                        ("sub-0", ["--gates", "substitute", "--substitutes", stats, "--fallback", "0"])):
        out_file = workdir / f"{name}.jsonl"
        proc = call(capsys, "generate", model, "--plan", plan, "--prompts", workdir / "test.jsonl",
                    "--max-new-tokens", "10", "--out", out_file, *extra)
        results[name] = [json.loads(line) for line in out_file.read_text().splitlines()]
        assert "fell back to every expert" in proc.stderr
    assert [r["token_ids"] for r in results["dial-0"]] == [r["token_ids"] for r in results["full"]]
    assert [r["token_ids"] for r in results["sub-0"]] == [r["token_ids"] for r in results["full"]]
    assert [r["token_ids"] for r in results["dial-1"]] == [r["token_ids"] for r in results["slimwise"]]


def test_errors_are_one_line_and_nonzero(workdir, capsys):
    cases = [
        ("prune", workdir / "model", "--stats", workdir / "missing.safetensors", "--out", workdir / "x"),
        ("prune", workdir / "model", "--plan", workdir / "calib.jsonl", "--out", workdir / "x"),
        ("calibrate", workdir / "nope", "--data", workdir / "calib.jsonl", "--out", workdir / "s"),
        ("generate", workdir / "model", "--mode", "slimwise", "--prompts", workdir / "test.jsonl"),
    ]
    for i, args in enumerate(cases):
        proc = run(*args, check=False) if i == 0 else call(capsys, *args, check=False)
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.startswith("slimwise: error:")]
        assert len(lines) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (workdir / "x").exists() and not (workdir / "s").exists()


def test_prune_ratio_refused(workdir, capsys):
    stats = workdir / "stats2.safetensors"
    call(capsys, "calibrate", workdir / "model", "--data", workdir / "calib.jsonl",
         "--phase", "prompt", "--out", stats)
    for ratio in ("1.0", "-0.2", "0.9"):
        proc = call(capsys, "prune", workdir / "model", "--stats", stats, "--ratio", ratio,
                    "--out", workdir / "r", check=False)
        # 1.0 and -0.2 by the option's range (argparse, "slimwise prune: error: ..."),
        # 0.9 by the plan (below top-k)
        assert proc.returncode == 2 and proc.stderr.startswith("slimwise") and ": error: " in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not (workdir / "r").exists()
    shutil.rmtree(workdir / "r", ignore_errors=True)



# ----- options generated from the config dataclasses (slimwise.options) ------------------------------------

def _subparser(name: str):
    from slimwise.cli import build_parser

    return build_parser()._subparsers._group_actions[0].choices[name]


def _config_class(command: str):
    from slimwise.distill import DistillConfig
    from slimwise.evaluation.config import EvalConfig
    from slimwise.perf.bench_config import BenchConfig
    from slimwise.serving.config import ServeConfig

    return {"eval": EvalConfig, "bench": BenchConfig, "serve": ServeConfig, "distill": DistillConfig}[command]


#: where a command line's default differs from its config's on purpose: `slimwise serve` logs routing counters
CLI_DEFAULTS = {("serve", "log_every"): 100}


@pytest.mark.parametrize("command", ["eval", "bench", "serve", "distill"])
def test_every_option_field_is_an_option_with_the_fields_default(command):
    """A field whose metadata makes it an option is on its command line, defaulting to the field's default
    (the one declaration)."""
    from slimwise.options import dest_of, option_fields

    config_cls = _config_class(command)
    defaults = config_cls(**({"model": "m"} if command == "serve" else {}))
    actions = {a.dest: a for a in _subparser(command)._actions}
    fields = option_fields(config_cls)
    assert fields and {dest_of(f) for f in fields.values()} <= set(actions)
    for name, f in fields.items():
        action = actions[dest_of(f)]
        if f.type != "bool" and action.default is not None:
            assert action.default == CLI_DEFAULTS.get((command, name), getattr(defaults, name)), name


def test_options_helper_flags_conversions_and_explicit_values():
    import argparse
    from dataclasses import asdict, dataclass, field

    from slimwise.argtypes import integer
    from slimwise.options import add_dataclass_options, argv_of, command_of, config_from_args

    @dataclass
    class Toy:
        size: int = field(default=3, metadata={"type": integer(1), "help": "size (default %(default)s)"})
        kl: bool = field(default=True, metadata={"help": "skip KL"})
        resume: bool = field(default=False, metadata={"help": None})
        names: tuple[str, ...] = field(default=("a",), metadata={
            "flag": "--name", "action": "append", "convert": tuple, "render": list, "help": None})
        out_dir: str = field(default="out", metadata={"flag": "--out", "help": None})
        internal: int = 7

    p = argparse.ArgumentParser()
    add_dataclass_options(p, Toy)
    flags = [a.option_strings for a in p._actions[1:]]
    assert flags == [["--size"], ["--no-kl"], ["--resume"], ["--name"], ["--out"]]
    assert "--out OUT" in p.format_help() and "size (default 3)" in p.format_help()
    assert config_from_args(Toy, p.parse_args([])) == Toy()
    argv = ["--size", "5", "--no-kl", "--resume", "--name", "x", "--name", "y", "--out", "o"]
    got = config_from_args(Toy, p.parse_args(argv), internal=8)
    assert got == Toy(size=5, kl=False, resume=True, names=("x", "y"), out_dir="o", internal=8)
    with pytest.raises(ValueError, match="internal is not a command-line option"):
        add_dataclass_options(argparse.ArgumentParser(), Toy, ["internal"])
    # the inverse: the non-default options, in declaration order, parse back to the same config
    assert argv_of(Toy, asdict(got)) == argv and argv_of(Toy, asdict(Toy())) == []
    assert argv_of(Toy, asdict(Toy()), always=["size"]) == ["--size", "3"]
    assert argv_of(Toy, {"size": None}) == []  # no command line spells None: the default applies
    assert command_of("prog", ["--name", "a b", "--out", "o"]) == "prog --name 'a b' --out o"


def test_argv_of_spells_floats_exactly_and_wants_a_render_for_a_conversion():
    from dataclasses import dataclass, field

    from slimwise.options import argv_of

    @dataclass
    class Toy:
        lr: float = field(default=2e-3, metadata={"type": float, "help": None})
        gib: float = field(default=1.0, metadata={"convert": lambda g: g * 2**30, "help": None})
        batch: tuple[int, ...] = field(default=(1,), metadata={
            "type": int, "nargs": "+", "convert": tuple, "render": list, "help": None})

    assert argv_of(Toy, {"lr": 60.0}) == ["--lr", "60"]
    assert argv_of(Toy, {"lr": 1e-3}) == ["--lr", "0.001"]
    assert argv_of(Toy, {"lr": 0.1234567891}) == ["--lr", "0.1234567891"]  # not :g's six digits
    assert argv_of(Toy, {"batch": (8, 16)}) == ["--batch", "8", "16"]  # nargs: one flag, every value
    with pytest.raises(ValueError, match="Toy.gib converts its option: give it a render"):
        argv_of(Toy, {"gib": 2.0})


def test_kv_dir_cap_is_one_serve_option(capsys, monkeypatch):
    """`--kv-dir-max-gb` is parsed once, by `slimwise serve`'s parser (never taken out of the vLLM arguments):
    GB in, bytes in ServeConfig, the other unknown options passed to vLLM; a bad value is one line, exit 2."""
    import slimwise.serving.server as server

    seen = []
    monkeypatch.setattr(server, "serve", lambda cfg: seen.append(cfg) or 0)
    call(capsys, "serve", "m", "--dtype", "float32", "--kv-dir-max-gb", "0.5", "--max-num-seqs=4")
    assert seen[0].kv_dir_max_bytes == 2**29
    assert seen[0].vllm_args == ["--dtype", "float32", "--max-num-seqs=4"]
    call(capsys, "serve", "m")
    assert seen[1].kv_dir_max_bytes is None and seen[1].log_every == 100
    for bad in (["--kv-dir-max-gb"], ["--kv-dir-max-gb=0"], ["--kv-dir-max-gb", "nan"],
                ["--kv-dir-max-gb", "x"]):
        proc = call(capsys, "serve", "m", *bad, check=False)
        assert proc.returncode == 2 and len(seen) == 2
        assert proc.stderr.startswith("slimwise serve: error: argument --kv-dir-max-gb: ")
        assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow  # three Python processes, one of them training
def test_testbed_entry_points_run_as_modules(tmp_path):
    """`python -m slimwise.testbed.train` and `python -m slimwise.testbed.evaluate` (the commands model cards
    print) run as real processes: a tiny run without evaluation, then its evaluation, then its card."""
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    run_dir = tmp_path / "run"

    def module(name, *args):
        proc = subprocess.run([sys.executable, "-m", name, *map(str, args)], capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    overrides = [x for k, v in tiny.items() for x in ("--override", f"{k}={v}")]
    out = module("slimwise.testbed.train", "--backbone", "a", "--out", run_dir, "--max-steps", "2",
                 "--samples-per-family", "1", "--family-weights", "add=1", "--threads", "1", "--eval-n", "1",
                 "--heldout-n", "1", "--no-progress", "--no-eval", *overrides)
    assert out.strip().endswith(str(run_dir)) and not (run_dir / "eval.json").exists()
    config = json.loads((run_dir / "train_config.json").read_text())
    assert config["model_overrides"] == tiny and config["family_weights"] == {"add": 1.0}
    assert not config["progress"] and config["max_steps"] == 2
    out = module("slimwise.testbed.evaluate", "evaluate", run_dir, "--dtype", "float32")
    assert out.startswith("test: ") and (run_dir / "eval.json").is_file()
    assert module("slimwise.testbed.evaluate", "card", run_dir).strip() == str(run_dir / "README.md")
