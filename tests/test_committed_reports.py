"""The committed reports re-render bit for bit from their JSON with today's code.

A refactor of the report, bench or card writers must not change a published figure or a word of the published
text; these tests are what "moves change no behaviour" is checked against. Each compares a whole file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slimwise.evaluation.report import write_index, write_markdown
from slimwise.perf.bench import format_tables

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
EVAL_REPORTS = sorted(RESULTS.rglob("report.json"))
BENCH_REPORTS = sorted(p for p in (RESULTS / "perf").glob("bench-*.json") if p.with_suffix(".md").exists())
CHECKPOINTS = sorted((p for root in (ROOT / "slimwise" / "testbed", ROOT / "lab" / "testbed")
                      for p in (root / "checkpoints").iterdir() if p.is_dir()), key=lambda p: p.name)


def test_there_is_something_to_compare():
    assert len(EVAL_REPORTS) >= 9 and len(BENCH_REPORTS) >= 10 and len(CHECKPOINTS) == 5


@pytest.mark.parametrize("path", EVAL_REPORTS, ids=lambda p: str(p.parent.relative_to(RESULTS)))
def test_evaluation_report_rerenders(path, tmp_path):
    out = write_markdown(json.loads(path.read_text()), tmp_path / "report.md")
    assert out.read_text() == path.with_name("report.md").read_text()


def test_results_index_rerenders(tmp_path):
    names = ["testbed-a", "testbed-b", "testbed-c"]
    reports = [json.loads((RESULTS / n / "report.json").read_text()) for n in names]
    assert write_index(reports, tmp_path, names).read_text() == (RESULTS / "index.md").read_text()


@pytest.mark.parametrize("path", BENCH_REPORTS, ids=lambda p: p.stem)
def test_bench_report_rerenders(path):
    assert format_tables(json.loads(path.read_text())) == path.with_suffix(".md").read_text()


@pytest.mark.parametrize("ckpt", CHECKPOINTS, ids=lambda p: p.name)
def test_model_card_rerenders(ckpt, tmp_path):
    from lab.testbed.evaluate import write_card

    copy = tmp_path / ckpt.name
    shutil.copytree(ckpt, copy)
    (copy / "README.md").unlink()
    assert write_card(copy).read_text() == (ckpt / "README.md").read_text()


def test_decode_gates_table_rerenders():
    from experiments.decode_gates import markdown

    data = json.loads((RESULTS / "decode-gates" / "decode-gates.json").read_text())
    assert markdown(data["results"], data["environment"]) \
        == (RESULTS / "decode-gates" / "decode-gates.md").read_text()


def test_layer_budgets_table_rerenders():
    from experiments.layer_budgets import markdown

    data = json.loads((RESULTS / "layer-budgets" / "layer-budgets.json").read_text())
    assert markdown(data["results"], data["environment"]) \
        == (RESULTS / "layer-budgets" / "layer-budgets.md").read_text()


def test_frontier_table_rerenders_with_its_pareto_marks():
    from experiments.frontier import markdown, merged, pareto

    data = json.loads((RESULTS / "frontier" / "frontier.json").read_text())
    assert markdown(data) == (RESULTS / "frontier.md").read_text()
    # every benched row not on the front is beaten on both axes by another benched row or by full
    for model in {r["model"] for r in data["speed"]}:
        rows = [r for r in merged(data) if r["model"] == model and r["bench"]]
        points = [(r["bench"]["speedup"], r["accuracy"]) for r in rows] + [(1.0, rows[0]["full"]["accuracy"])]
        front = pareto(points)
        for i, (x, y) in enumerate(points):
            if i not in front:
                assert any(x2 >= x and y2 >= y for j, (x2, y2) in enumerate(points) if j != i)


def test_long_prompts_table_rerenders_and_states_its_paired_figures():
    """docs/results/long-prompts.md from its committed reports; and its headline differences recomputed from
    the per-problem answers by another route (plain means) than the report's bootstrap."""
    from experiments.long_prompts import comparisons, markdown

    reports = json.loads((RESULTS / "long-prompts" / "reports.json").read_text())
    assert markdown(reports) + "\n" == (RESULTS / "long-prompts.md").read_text()
    for report in reports:
        for e in comparisons(report):
            row = report["ratios"][str(e["ratio"])]
            sw, un = row["slimwise"][str(e["length"])]["correct"], row["uniform"][str(e["length"])]["correct"]
            assert e["slimwise_vs_uniform"]["diff"] == pytest.approx((sum(sw) - sum(un)) / len(sw))
            ls, lu = row["slimwise"][str(e["length"])]["lengths"], row["uniform"][str(e["length"])]["lengths"]
            assert e["slimwise_vs_uniform_length"]["diff"] == pytest.approx((sum(ls) - sum(lu)) / len(ls))


def test_long_prompts_equal_steps_runs_get_their_own_section(tmp_path):
    """A run whose deltas train equal steps renders beside the wall-clock-capped run of the same model, not
    into it (one "Distilled:" line per regime), while training-free runs still merge into the capped
    section."""
    from experiments.long_prompts import _section, main, merge

    committed = json.loads((RESULTS / "long-prompts" / "reports.json").read_text())
    # a capped run made from a committed equal-steps one (the committed set has no capped run left)
    capped = json.loads(json.dumps(next(r for r in committed if r["config"]["distilled"]
                                        and r["config"]["distill"]["max_minutes"] is None)))
    capped["config"]["distill"] |= {"max_minutes": 7.0, "steps": 1200}
    steps = json.loads(json.dumps(capped))
    steps["config"]["distilled"] = True  # the committed merge keeps its training-free run's config
    steps["config"]["distill"] |= {"max_minutes": None, "steps": 120}
    steps["ratios"] = {"0.5": steps["ratios"]["0.5"]}
    free = json.loads(json.dumps(capped))
    free["config"]["distilled"] = False
    free["ratios"] = {r: {m: row[m] for m in ("uniform", "slimwise")} for r, row in free["ratios"].items()}
    merged = merge([capped, steps, free])
    assert [_section(r) for r in merged] == [capped["model"], f"{capped['model']}, equal distillation steps"]
    assert merged[0]["ratios"] == capped["ratios"]  # the fuller capped rows win over the training-free ones
    assert list(merged[1]["ratios"]) == ["0.5"]
    paths = []
    for i, rep in enumerate((capped, steps)):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(rep))
    assert main(["report", *map(str, paths), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out.md").read_text()
    assert f"## {capped['model']}, equal distillation steps" in text
    assert text.count("Distilled:") == 2 and "120 steps of" in text and "capped at 7 min" in text
    assert (tmp_path / "out" / "accuracy_vs_length.png").stat().st_size > 10_000


def test_long_prompts_report_rebuilds_from_its_own_reports_json(tmp_path):
    """`report` reads the merged reports.json it wrote (how a new backbone's run joins the committed tables
    without the earlier runs' directories): the same page again."""
    from experiments.long_prompts import main

    committed = RESULTS / "long-prompts" / "reports.json"
    assert main(["report", str(committed), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out.md").read_text() == (RESULTS / "long-prompts.md").read_text()
    assert json.loads((tmp_path / "out" / "reports.json").read_text()) == json.loads(committed.read_text())
