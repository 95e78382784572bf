"""SlimWise inside stock vLLM: a general plugin, SlimWise model classes, and the decode-only router masking.

Loaded in every vLLM process through the `vllm.general_plugins` entry point
(`slimwise.serving.plugin:register`).
"""
