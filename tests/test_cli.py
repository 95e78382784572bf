"""The `slimwise` command line: the full core flow and its error handling.

Each test runs its first command as a real process (`python -m slimwise.cli`: exit code, stdout and stderr as
a user sees them) and the rest in this process through `slimwise.cli.main`, the same entry point without
importing torch and transformers again per command, which dominates a tiny model's command
(docs/history/measurement-notes.md).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import save_tiny_model

from lab.testbed.tokenizer import build_tokenizer
from slimwise.testbed import export_jsonl, make_split

SLIMWISE = [sys.executable, "-m", "slimwise.cli"]
ROOT = Path(__file__).resolve().parents[1]


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
    for name in ("calibrate", "plan", "prune", "generate", "demo", "bench"):
        assert name in out
    # the perf studies are the lab's (`python -m lab.perf.cli`), not the product's
    listed = re.findall(r"^    ([a-z-]+)(?:\s|$)", out, re.M)
    assert "bench" in listed and not {"roofline", "calib-cost", "policy-quality"} & set(listed), listed


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


def _config_classes(command: str) -> tuple:
    """The config dataclasses whose fields make `command`'s options (each class's every option field)."""
    from slimwise.calibrate import CalibrateCommand, CalibrationConfig
    from slimwise.demo import DemoConfig
    from slimwise.distill import DistillConfig
    from slimwise.distill_config import DistillCommand
    from slimwise.engines.reference import GenerateCommand, GenerationConfig
    from slimwise.evaluation.config import EvalConfig
    from slimwise.perf.bench_config import BenchConfig
    from slimwise.plan_config import PlanCommand, PruneCommand
    from slimwise.serving.config import ServeConfig

    return {"calibrate": (CalibrateCommand, CalibrationConfig), "plan": (PlanCommand,),
            "prune": (PruneCommand,), "generate": (GenerateCommand, GenerationConfig),
            "distill": (DistillCommand, DistillConfig), "eval": (EvalConfig,),
            "serve": (ServeConfig,), "bench": (BenchConfig,), "demo": (DemoConfig,)}[command]


#: where a command line's default differs from its config's on purpose: `slimwise serve` logs routing counters
CLI_DEFAULTS = {("serve", "log_every"): 100}
#: the options written by hand in slimwise/cli.py (or perf/cli.py), not fields of a config: those the command
#: reads into several fields (eval's MODEL list and --route, serve's --plan), eval's --no-calib-mixes and
#: bench's --from-json
HAND_WRITTEN = {"eval": {"models", "no_calib_mixes", "route"}, "serve": {"plan"}, "bench": {"from_json"}}


def check_options_have_field_defaults(parser, config_classes, cli_defaults=None) -> None:
    """Every option field of `config_classes` is an option of `parser`, and with only the required arguments
    given it parses to the field's default (`cli_defaults`: field name -> a deliberate command-line default):
    argparse's own default is that default -- None included -- except for a flag (store_true) and an option
    with `convert` or `append` (None: the field keeps its default), and `config_from_args` gives it back."""
    import dataclasses

    from slimwise.options import default_of, dest_of, option_fields, values_from_args

    actions = {a.dest: a for a in parser._actions}
    required = [a for a in parser._actions if a.required]
    argv = [w for a in required for w in ([a.option_strings[0]] if a.option_strings else []) + ["x"]]
    args = parser.parse_args(argv)
    for config_cls in config_classes:
        fields = option_fields(config_cls)
        values = values_from_args(config_cls, args)
        assert fields, config_cls
        for name, f in fields.items():
            where = f"{config_cls.__name__}.{name}"
            assert dest_of(f) in actions, f"{where} is not an option"
            default = default_of(f)
            action = actions[dest_of(f)]
            if default is dataclasses.MISSING:  # required: the value given
                assert values[name] == (["x"] if action.nargs == "+" else "x"), where
                continue
            expected = (cli_defaults or {}).get(name, default)
            if isinstance(action, argparse._StoreTrueAction):  # a flag flips its field's default
                assert action.default is False, where
            elif "convert" in f.metadata or f.metadata.get("action") == "append":
                assert action.default is None, where
            else:
                assert action.default == expected and type(action.default) is type(expected), where
            assert values.get(name, default) == expected, where


@pytest.mark.parametrize("command", ["calibrate", "plan", "prune", "generate", "distill", "eval", "serve",
                                     "bench", "demo"])
def test_every_option_field_is_an_option_with_the_fields_default(command):
    """A field whose metadata makes it an option is on its command line, defaulting to the field's default
    (the one declaration), for every field, those defaulting to None included; and every other option is one
    of the few written by hand."""
    from slimwise.options import dest_of, option_fields

    parser, classes = _subparser(command), _config_classes(command)
    check_options_have_field_defaults(parser, classes,
                                      {n: v for (c, n), v in CLI_DEFAULTS.items() if c == command})
    declared = {dest_of(f) for cls in classes for f in option_fields(cls).values()}
    written = {a.dest for a in parser._actions if a.dest != "help"} - declared
    assert written == HAND_WRITTEN.get(command, set())


def test_the_defaults_check_fails_on_a_wrong_default():
    """The check above can fail: an option whose command-line default is not its field's, a None default
    that parses to something else, a field that is not an option."""
    from dataclasses import dataclass, field

    from slimwise.options import add_dataclass_options

    @dataclass
    class Toy:
        size: int = field(default=3, metadata={"type": int, "help": None})
        name: str | None = field(default=None, metadata={"help": None})

    good = argparse.ArgumentParser()
    add_dataclass_options(good, Toy)
    check_options_have_field_defaults(good, (Toy,))
    for size, name in ((4, None), (3, "x")):
        wrong = argparse.ArgumentParser()
        wrong.add_argument("--size", type=int, default=size)
        wrong.add_argument("--name", default=name)
        with pytest.raises(AssertionError, match="Toy.(size|name)"):
            check_options_have_field_defaults(wrong, (Toy,))
    missing = argparse.ArgumentParser()
    add_dataclass_options(missing, Toy, ("size",))
    with pytest.raises(AssertionError, match="Toy.name is not an option"):
        check_options_have_field_defaults(missing, (Toy,))


def test_library_configs_are_their_options_defaults():
    """`calibrate` and `generate` build the library's configs from the options: with no option given, those
    are the configs' own defaults (the one declaration), plus what the command sets itself."""
    from slimwise.calibrate import CalibrationConfig
    from slimwise.engines.reference import GenerationConfig
    from slimwise.options import config_from_args

    args = _subparser("calibrate").parse_args(["m", "--data", "d", "--out", "o"])
    assert config_from_args(CalibrationConfig, args) == CalibrationConfig()
    args = _subparser("generate").parse_args(["m", "--prompts", "p"])
    assert config_from_args(GenerationConfig, args) == GenerationConfig()
    args = _subparser("generate").parse_args(["m", "--prompts", "p", "--stop", "a", "--stop", "b"])
    assert config_from_args(GenerationConfig, args).stop == ("a", "b")


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
    """The lab's entry points run as real processes from the repository root (the lab is not installed):
    `python -m lab.testbed.train` (a tiny run without evaluation), `python -m lab.testbed.evaluate` (its
    evaluation, then its card) and `python -m lab.perf.cli` (a roofline, and a refusal in one line)."""
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    run_dir = tmp_path / "run"

    def module(name, *args, code=0):
        proc = subprocess.run([sys.executable, "-m", name, *map(str, args)], capture_output=True, text=True,
                              timeout=600, cwd=ROOT)
        assert proc.returncode == code, proc.stderr
        return proc.stdout if code == 0 else proc.stderr

    overrides = [x for k, v in tiny.items() for x in ("--override", f"{k}={v}")]
    out = module("lab.testbed.train", "--backbone", "a", "--out", run_dir, "--max-steps", "2",
                 "--samples-per-family", "1", "--family-weights", "add=1", "--threads", "1", "--eval-n", "1",
                 "--heldout-n", "1", "--no-progress", "--no-eval", *overrides)
    assert out.strip().endswith(str(run_dir)) and not (run_dir / "eval.json").exists()
    config = json.loads((run_dir / "train_config.json").read_text())
    assert config["model_overrides"] == tiny and config["family_weights"] == {"add": 1.0}
    assert not config["progress"] and config["max_steps"] == 2
    out = module("lab.testbed.evaluate", "evaluate", run_dir, "--dtype", "float32")
    assert out.startswith("test: ") and (run_dir / "eval.json").is_file()
    assert module("lab.testbed.evaluate", "card", run_dir).strip() == str(run_dir / "README.md")
    out = module("lab.perf.cli", "roofline", "--preset", "cpu", "--hardware", "h100", "--batch", "1", "8")
    assert "weights-only ceiling" in out and "## h100" in out
    err = module("lab.perf.cli", "roofline", "--config", tmp_path / "missing.json", code=2)
    assert err.startswith("python -m lab.perf.cli: error: config ") and err.count("\n") == 1, err
