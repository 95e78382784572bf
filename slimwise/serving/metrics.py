"""SlimWise's counters on vLLM's Prometheus `/metrics`, so an operator can see that pruning is on.

The colocated server's middleware (`plan_select.py`) appends these families to vLLM's own answer, from the
workers' routing counters (`collective_rpc("slimwise_counters")`, the first worker that carries a routing:
tensor-parallel ranks count the same rows). Counters restart when the mode is switched (the start-up
self-check switches it once); Prometheus' `rate()` treats that as a reset. The disaggregated proxy serves the
decode instance's own `/metrics` followed by its counters (`render_proxy`).
"""

from __future__ import annotations


def _counter(name: str, doc: str, value=None, label: str | None = None, by_label: dict | None = None):
    """A counter family: one sample `value`, or one sample per `by_label` entry under `label`."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=[label] if label else None)
    for key, sample in (by_label.items() if label else [(None, value)]):
        family.add_metric([key] if label else [], sample)
    return family


def _gauge(name: str, doc: str, value: float | None):
    """A gauge family, without a sample while `value` is None."""
    from prometheus_client.core import GaugeMetricFamily

    family = GaugeMetricFamily(name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


def _exposition(families: list) -> bytes:
    """Prometheus' text format of `families`, written by prometheus_client."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(type("Families", (), {"collect": lambda self: iter(families)})())
    return generate_latest(registry)


def render_proxy(stats: dict, decode_text: str | None) -> bytes:
    """The disaggregated proxy's `/metrics`: the decode instance's own (vLLM's families for the pruned
    decoder, where decode throughput is made) followed by the proxy's counters; when the decode instance does
    not answer, the proxy's alone with `slimwise_proxy_decode_metrics_up 0`."""
    families = [_counter(f"slimwise_proxy_{key}", f"The proxy's {key} (also on /health).", value)
                for key, value in stats.items() if isinstance(value, int) and not isinstance(value, bool)]
    families.append(_gauge("slimwise_proxy_decode_metrics_up",
                           "1: the decode instance's own metrics are included above.",
                           0.0 if decode_text is None else 1.0))
    return (decode_text or "").encode() + _exposition(families)


def render(counters: list[dict], self_check: bool | None) -> bytes:
    """The Prometheus text of SlimWise's families."""
    c = next((w for w in counters if w), {})
    plans = c.get("plan_names", ["full"])[1:]
    # one plan: every pruned token is its own (per-plan counts are kept with several)
    by_plan = c.get("plan_tokens") or ({plans[0]: c.get("pruned_tokens", 0)} if len(plans) == 1 else {})
    pruned_doc = "Generated tokens routed with a plan's kept experts."
    return _exposition([
        _counter("slimwise_steps", "Forward steps SlimWise set routing rows for.", c.get("steps", 0)),
        _counter("slimwise_decode_tokens_pruned", pruned_doc, label="plan",
                 by_label={name: by_plan.get(name, 0) for name in plans}),
        _counter("slimwise_tokens_full_routed", "Tokens routed with every expert (prompt tokens, plan full).",
                 c.get("full_tokens", 0)),
        _counter("slimwise_fallback_token_layers",
                 "Pruned-routed token-layer pairs that fell back to every expert (--fallback; counted when "
                 "expert counting is on).", sum(v[2] for v in (c.get("fallback") or {}).values())),
        _counter("slimwise_unknown_plan_requests",
                 "Requests naming a plan the engine does not serve (full-routed).",
                 c.get("unknown_plan_requests", 0)),
        _gauge("slimwise_self_check_passed", "1: the start-up self-check saw every plan's mask in effect; "
               "0: it failed; absent: not run yet.", None if self_check is None else float(self_check)),
    ])
