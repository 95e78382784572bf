"""SlimWise: decode-only expert pruning for MoE serving."""
