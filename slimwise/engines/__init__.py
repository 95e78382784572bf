"""The two engines that generate with a plan: the transformers reference (`reference.PhaseSplitEngine`, full
prefill then pruned decode, the definition every other path is compared with) and vLLM offline (`vllm_engine.
VllmEngine`, the same interface on the served kernels). Neither imports the trainer or the evaluation."""
