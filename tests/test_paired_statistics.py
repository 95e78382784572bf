"""Exact paired tests for the published comparisons: McNemar's exact test on the discordant problems and
Holm's correction over a table's family of comparisons, checked against hand-computed values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from slimwise.evaluation.metrics import holm, mcnemar_exact, paired_difference, significant
from slimwise.evaluation.report import signed_pp
from slimwise.evaluation.report_assembly import paired_comparisons, summary_section


def test_mcnemar_is_the_two_sided_binomial_on_discordant_pairs():
    # 26 problems only a solves, 13 only b, 5 both: 2 * P(X <= 13), X ~ Binomial(39, 1/2)
    a = [1] * 26 + [0] * 13 + [1] * 5 + [0] * 7
    b = [0] * 26 + [1] * 13 + [1] * 5 + [0] * 7
    r = mcnemar_exact(a, b)
    assert (r["a_only"], r["b_only"]) == (26, 13)
    assert r["p_exact"] == pytest.approx(2 * sum(math.comb(39, i) for i in range(14)) / 2 ** 39)
    assert round(r["p_exact"], 3) == 0.053
    assert mcnemar_exact(b, a)["p_exact"] == r["p_exact"]  # symmetric
    assert mcnemar_exact([1, 1, 1, 1, 1], [0] * 5)["p_exact"] == pytest.approx(2 / 32)
    assert mcnemar_exact([1, 0, 1], [1, 0, 1])["p_exact"] == 1.0  # nothing discordant
    assert mcnemar_exact([1, 0], [0, 1])["p_exact"] == 1.0  # capped
    with pytest.raises(ValueError, match="differ in length"):
        mcnemar_exact([1, 0], [1])


def test_holm_multiplies_by_the_remaining_count_and_never_decreases():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == [1.0, 1.0]
    assert holm([]) == []


def test_a_table_is_one_family_and_significance_follows_the_adjusted_p():
    """Two plans: one where SlimWise wins 20 of 20 discordant problems (significant after Holm over the
    table's six differences), one where it wins 4 of 4 (p = 0.125 alone: not significant)."""
    n = 40
    full = {"correct": [1] * n}
    runs = []
    for label, wins in (("a", 20), ("b", 4)):
        sw = [1] * wins + [0] * (n - wins)
        runs += [{"label": label, "mode": "slimwise", "criterion": "reap", "ratio": 0.5, "phase": "decode",
                  "metrics": {"correct": sw}},
                 {"label": label, "mode": "uniform", "criterion": "reap", "ratio": 0.5, "phase": "decode",
                  "metrics": {"correct": [0] * n}}]
    comps = paired_comparisons(full, runs, n_boot=200, seed=0)
    cells = [d for c in comps for k, d in c.items() if "_minus_" in k]
    assert len(cells) == 6 and all("p_holm" in d and d["p_holm"] >= d["p_exact"] for d in cells)
    a, b = (c["slimwise_minus_uniform"] for c in comps)
    assert significant(a, 1) and not significant(a, -1)
    assert a["p_exact"] < 0.05 and not significant(b, 1)
    assert "**↑**" in signed_pp(a) and "p=" in signed_pp(a) and "**↑**" not in signed_pp(b)
    summary = summary_section(comps, {"accuracy": 1.0}, n)
    assert (summary["slimwise_better"], summary["no_significant_difference"]) == (1, 1)


def test_reports_without_exact_p_keep_the_bootstrap_rule():
    d = {"diff": 0.1, "ci_low": 0.01, "ci_high": 0.2}
    assert significant(d, 1) and signed_pp(d) == "+10.0 pp [+1.0, +20.0] **↑**"
    assert set(paired_difference([1, 0], [0, 0], n_boot=10)) >= {"diff", "ci_low", "ci_high", "p_exact"}


def test_the_fair_baseline_table_re_renders_from_its_per_problem_outcomes(tmp_path):
    """docs/results/fair-baseline.md is a pure function of the committed per-problem outcomes: the analysis
    run afresh writes the same bytes, and its verdict follows the rule (a lead at every calibration seed)."""
    from experiments import fair_baseline

    root = Path(__file__).resolve().parents[1]
    fair_baseline.main(["--source", str(root / fair_baseline.SOURCE), "--out", str(tmp_path)])
    assert (tmp_path / "fair-baseline.md").read_text() == (root / "docs/results/fair-baseline.md").read_text()
    report = json.loads((tmp_path / "fair-baseline.json").read_text())
    for row in report["rows"]:
        assert row["lead"] == all(c["diff"] > 0 and c["p_holm"] < 0.05 for c in row["seeds"].values())
