"""SlimWise's counters on vLLM's Prometheus `/metrics`, so an operator can see that pruning is on.

The colocated server's middleware (`plan_select.py`) appends these families to vLLM's own answer, from the
workers' routing counters (`collective_rpc("slimwise_counters")`, the first worker that carries a routing:
tensor-parallel ranks count the same rows). Counters restart when the mode is switched (the start-up
self-check switches it once); Prometheus' `rate()` treats that as a reset.
"""

from __future__ import annotations


def render_proxy(stats: dict, decode_text: str | None) -> bytes:
    """The disaggregated proxy's `/metrics`: the decode instance's own (vLLM's families for the pruned
    decoder, where decode throughput is made) followed by the proxy's counters; when the decode instance does
    not answer, the proxy's alone with `slimwise_proxy_decode_metrics_up 0`."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):
            for key, value in stats.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    family = CounterMetricFamily(f"slimwise_proxy_{key}",
                                                 f"The proxy's {key} (also on /health).")
                    family.add_metric([], value)
                    yield family
            up = GaugeMetricFamily("slimwise_proxy_decode_metrics_up",
                                   "1: the decode instance's own metrics are included above.")
            up.add_metric([], 0.0 if decode_text is None else 1.0)
            yield up

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return (decode_text or "").encode() + generate_latest(registry)


def render(counters: list[dict], self_check: bool | None) -> bytes:
    """The Prometheus text of SlimWise's families."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    c = next((w for w in counters if w), {})

    class Collector:
        def collect(self):
            steps = CounterMetricFamily("slimwise_steps", "Forward steps SlimWise set routing rows for.")
            steps.add_metric([], c.get("steps", 0))
            yield steps
            pruned = CounterMetricFamily("slimwise_decode_tokens_pruned",
                                         "Generated tokens routed with a plan's kept experts.",
                                         labels=["plan"])
            plans = c.get("plan_names", ["full"])[1:]
            # one plan: every pruned token is its (per-plan counts are kept with several)
            by_plan = c.get("plan_tokens") or (
                {plans[0]: c.get("pruned_tokens", 0)} if len(plans) == 1 else {})
            for name in plans:
                pruned.add_metric([name], by_plan.get(name, 0))
            yield pruned
            full = CounterMetricFamily("slimwise_tokens_full_routed",
                                       "Tokens routed with every expert (prompt tokens, plan full).")
            full.add_metric([], c.get("full_tokens", 0))
            yield full
            fallback = CounterMetricFamily(
                "slimwise_fallback_token_layers",
                "Pruned-routed token-layer pairs that fell back to every expert (--fallback; counted when "
                "expert counting is on).")
            fallback.add_metric([], sum(v[2] for v in (c.get("fallback") or {}).values()))
            yield fallback
            unknown = CounterMetricFamily("slimwise_unknown_plan_requests",
                                          "Requests naming a plan the engine does not serve (full-routed).")
            unknown.add_metric([], c.get("unknown_plan_requests", 0))
            yield unknown
            check = GaugeMetricFamily("slimwise_self_check_passed",
                                      "1: the start-up self-check saw every plan's mask in effect; 0: it "
                                      "failed; absent: not run yet.")
            if self_check is not None:
                check.add_metric([], 1.0 if self_check else 0.0)
            yield check

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)
