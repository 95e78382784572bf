"""More calibration seeds for the long-prompt rows of the fair comparison (docs/results/fair-baseline.md).

testbed-a-long, 150 test problems at 1,024 characters (test seed 0), float32 reference engine, greedy, 48
new tokens, batch 32, REAP: static SlimWise (plan calibrated on decode tokens) against uniform pruning
calibrated on whole sequences, at 25, 50 and 75%. The recipe is batch_budgets.py's long stage (calibration
seed 0 there: 8 calibration problems per family at each prompt length, 32 new tokens) with the calibration
sample drawn at other seeds; one calibration per seed and phase serves the three ratios.

    python -m experiments.fair_long_seeds --seeds 1 2
    python -m experiments.fair_long_seeds --by-length --seeds 0 1 2

`--by-length`: the same comparison at 50% at the shorter prompt lengths (64, 256 and 512 characters, 150 test
problems each), one calibration per seed and phase for every length: where full prefill starts to pay.

Writes OUT/long-seed{S}.json per seed (default OUT docs/results/fair-baseline; skipped when present): the
per-problem outcomes `experiments.fair_baseline` reads beside the seed-0 rows batch_budgets.py committed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slimwise.io import atomic_write_text

MODEL, LENGTH, RATIOS = "testbed-a-long", 1024, (0.25, 0.5, 0.75)


OUT = Path("docs/results/fair-baseline")


def seed_path(out: Path, seed: int) -> Path:
    return Path(out) / f"long-seed{seed}.json"


def run_seed(out_dir: Path, seed: int) -> dict:
    """{ratio: {"uniform": cell, "static": cell}} for one calibration seed (cells: accuracy, n, correct)."""
    from dataclasses import replace as with_

    from experiments.distill_bars import BarsConfig, evaluate_run
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.engines.reference import PhaseSplitEngine
    from slimwise.models import load_model, load_tokenizer
    from slimwise.testbed.long_tasks import LENGTHS, make_long_split

    path = seed_path(out_dir, seed)
    if path.is_file():
        return json.loads(path.read_text())
    model, tok = load_model(MODEL, dtype="float32"), load_tokenizer(MODEL)
    bars = with_(BarsConfig(), max_new_tokens=48, batch_size=32)
    tests = make_long_split("test", 50, LENGTH, seed=0)
    calib = [s.prompt for n in LENGTHS for s in make_long_split("calib", 8, n, seed=seed)]
    stats = {phase: calibrate(model, calib, tok, CalibrationConfig(phase=phase, max_new_tokens=32),
                              progress=False) for phase in ("decode", "all")}
    with PhaseSplitEngine(model, tok) as engine:
        full = evaluate_run(engine, tests, "full", bars)
    out: dict = {"model": MODEL, "length": LENGTH, "calib_seed": seed, "n": len(tests),
                 "full": {"accuracy": full["accuracy"] / 100, "correct": full["correct"]}, "ratios": {}}
    for ratio in RATIOS:
        cells = {}
        for name, phase, mode in (("uniform", "all", "uniform"), ("static", "decode", "slimwise")):
            plan = plan_from_stats(stats[phase], "reap", ratio)
            with PhaseSplitEngine(model, tok, plan=plan) as engine:
                run = evaluate_run(engine, tests, mode, bars, full["token_ids"])
            cells[name] = {"accuracy": run["accuracy"] / 100, "n": len(run["correct"]),
                           "correct": run["correct"]}
        out["ratios"][f"{ratio:g}"] = cells
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out))
    return out


SHORTER = (64, 256, 512)


def length_path(out: Path, seed: int) -> Path:
    return Path(out) / f"by-length-seed{seed}.json"


def run_lengths(out_dir: Path, seed: int, lengths=SHORTER, ratio: float = 0.5) -> dict:
    """{length: {"full", "uniform", "static": cell}} at `ratio` for one calibration seed."""
    from dataclasses import replace as with_

    from experiments.distill_bars import BarsConfig, evaluate_run
    from slimwise.calibrate import CalibrationConfig, calibrate
    from slimwise.criteria import plan_from_stats
    from slimwise.engines.reference import PhaseSplitEngine
    from slimwise.models import load_model, load_tokenizer
    from slimwise.testbed.long_tasks import LENGTHS, make_long_split

    path = length_path(out_dir, seed)
    if path.is_file():
        return json.loads(path.read_text())
    model, tok = load_model(MODEL, dtype="float32"), load_tokenizer(MODEL)
    bars = with_(BarsConfig(), max_new_tokens=48, batch_size=32)
    calib = [s.prompt for n in LENGTHS for s in make_long_split("calib", 8, n, seed=seed)]
    plans = {phase: plan_from_stats(calibrate(model, calib, tok, CalibrationConfig(phase=phase,
                                                                                    max_new_tokens=32),
                                              progress=False), "reap", ratio) for phase in ("decode", "all")}
    out: dict = {"model": MODEL, "ratio": ratio, "calib_seed": seed, "lengths": {}}
    for length in lengths:
        tests = make_long_split("test", 50, length, seed=0)
        with PhaseSplitEngine(model, tok) as engine:
            full = evaluate_run(engine, tests, "full", bars)
        cells = {"full": {"accuracy": full["accuracy"] / 100, "n": len(full["correct"]),
                          "correct": full["correct"]}}
        for name, phase, mode in (("uniform", "all", "uniform"), ("static", "decode", "slimwise")):
            with PhaseSplitEngine(model, tok, plan=plans[phase]) as engine:
                run = evaluate_run(engine, tests, mode, bars, full["token_ids"])
            cells[name] = {"accuracy": run["accuracy"] / 100, "n": len(run["correct"]),
                           "correct": run["correct"]}
        out["lengths"][str(length)] = cells
        print(seed, length, {k: round(100 * c["accuracy"], 1) for k, c in cells.items()}, flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(out))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--by-length", action="store_true", help="50%% at 64, 256 and 512 characters")
    args = parser.parse_args(argv)
    if args.by_length:
        for seed in args.seeds:
            run_lengths(args.out, seed)
        return
    for seed in args.seeds:
        out = run_seed(args.out, seed)
        print(seed, {r: {k: round(100 * c["accuracy"], 1) for k, c in cells.items()}
                     for r, cells in out["ratios"].items()}, flush=True)


if __name__ == "__main__":
    main()
