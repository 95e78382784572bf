"""Expert traffic of decode steps: distinct experts touched per MoE layer, measured against the expectation.

The measurement comes from the vLLM plugin's routing counters (`slimwise_count_experts`: a hook on every gate
records, on each step with decode tokens, how many distinct experts those tokens selected). The expectation is
uniform routing: B tokens each picking k of E' available experts touch E'·(1 − (1 − k/E')^B) per layer, E'
being the experts a decode token can reach (all E for the full model, the kept ones when pruned).
"""

from __future__ import annotations

from slimwise.perf.roofline import expected_union


def _int_keys(d: dict | None) -> dict[int, float]:
    """collective_rpc serialises dict keys to strings: map them back to ints."""
    return {int(k): v for k, v in (d or {}).items()}


def counters_delta(before: dict, after: dict) -> dict:
    """Per-layer sums of distinct experts touched and counted steps between two counter snapshots (one
    worker)."""
    sb, sa = _int_keys(before.get("experts_touched_sum")), _int_keys(after.get("experts_touched_sum"))
    nb, na = _int_keys(before.get("experts_counted_steps")), _int_keys(after.get("experts_counted_steps"))
    bb, ba = _int_keys(before.get("touched_by_batch")), _int_keys(after.get("touched_by_batch"))
    by_batch = {}
    for b, (steps, total) in ba.items():
        s0, t0 = bb.get(b, (0, 0))
        if steps - s0:
            by_batch[b] = (steps - s0, total - t0)
    fb, fa = _int_keys(before.get("fallback")), _int_keys(after.get("fallback"))
    fallback = [sum(v[i] - fb.get(layer, (0, 0, 0))[i] for layer, v in fa.items()) for i in range(3)]
    return {"touched": {layer: sa[layer] - sb.get(layer, 0) for layer in sa},
            "steps": {layer: na[layer] - nb.get(layer, 0) for layer in na},
            "decode_steps": int(after.get("decode_steps", 0)) - int(before.get("decode_steps", 0)),
            "by_batch": by_batch, "fallback": fallback}


def summarize_traffic(delta: dict, *, batch: int, available_experts: int, top_k: int,
                      expert_bytes: float) -> dict:
    """Mean distinct experts per layer per decode step, expert bytes read per step, and the uniform
    expectation.

    Only steps whose decode batch equals `batch` enter the mean when the counters say so (the last steps of a
    batch may run with fewer sequences if some finish early; with ignore_eos and equal lengths they do not).
    """
    per_layer = {layer: delta["touched"][layer] / n for layer, n in delta["steps"].items() if n > 0}
    counted = sum(delta["steps"].values())
    at_batch = delta["by_batch"].get(batch)
    mean = (at_batch[1] / at_batch[0]) if at_batch else (sum(per_layer.values()) / len(per_layer) if per_layer
                                                         else float("nan"))
    layers = len(per_layer)
    expected = expected_union(available_experts, top_k, batch)
    routed, touching, fell_back = delta.get("fallback") or (0, 0, 0)
    fallback = {"fallback_share": fell_back / routed, "touching_pruned_share": touching / routed} \
        if routed else {}
    return {
        **fallback,
        "batch": batch, "decode_steps": delta["decode_steps"], "layer_steps_counted": counted,
        "available_experts": available_experts, "top_k": top_k,
        "touched_per_layer": {str(k): round(v, 3) for k, v in sorted(per_layer.items())},
        "touched_mean": mean, "expected_uniform": expected,
        "touched_over_expected": mean / expected if expected else float("nan"),
        "expert_bytes_per_step": mean * layers * expert_bytes,
        "expected_expert_bytes_per_step": expected * layers * expert_bytes,
        "all_expert_bytes": available_experts * layers * expert_bytes,
    }


__all__ = ["counters_delta", "expected_union", "summarize_traffic"]
