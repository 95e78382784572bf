"""lm-evaluation-harness model `slimwise`: run any lm-eval task through full prefill + pruned decode.

What is judged is the decode-phase model, in the same phase split as serving:
  - `generate_until`: the reference engine in the chosen mode (default slimwise: the full model prefills the
    context, the pruned decoder generates) with the task's stop strings;
  - `loglikelihood`: the full model prefills the context into a cache; the first continuation token is
    scored by the full model's last context logits (as the first generated token would be), the rest are
    teacher-forced through the pruned decoder on that cache;
  - `loglikelihood_rolling`: lm-eval's rolling windows, each scored like `loglikelihood`.
Modes `full` and `uniform` give the baselines with the same code path; `distilled` (with delta=DIR from
`slimwise distill`) judges the distilled decoder.

Use (the model must be registered before lm-eval looks it up, so run lm-eval through this module):
    python -m slimwise.evaluation.lm_eval_bridge --model slimwise \\
        --model_args pretrained=testbed-a,plan=plan.json,mode=slimwise --tasks TASK [--include_path DIR]
or in Python: `import slimwise.evaluation.lm_eval_bridge` then
`lm_eval.simple_evaluate(model="slimwise", ...)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# populate lm-eval's lazy registry first: its get_model only does so while the registry is empty
import lm_eval.models  # noqa: F401
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import model_registry, register_model

from slimwise.engines.reference import MODES, GenerationConfig, PhaseSplitEngine
from slimwise.errors import SlimWiseError
from slimwise.scoring import continuation_logprobs


def _register(cls: type[LM]) -> type[LM]:
    """register_model("slimwise"), once: `python -m` runs this file as __main__ besides any normal import."""
    if "slimwise" in model_registry:
        return cls
    return register_model("slimwise")(cls)


@_register
class SlimWiseLM(LM):
    """An `LM` over `PhaseSplitEngine`; the pruned decoder is a plan's masked
    view or an exported checkpoint."""

    def __init__(self, pretrained: str, plan: str | None = None, decode_model: str | None = None,
                 delta: str | None = None, mode: str = "slimwise", batch_size: int | str = 8,
                 max_gen_toks: int = 256, max_length: int | None = None, dtype: str = "auto",
                 device: str = "cpu", **kwargs: Any):
        super().__init__()
        from slimwise.export import load_pruned
        from slimwise.models import load_model, load_tokenizer
        from slimwise.plan import PrunePlan

        if mode not in MODES:
            raise SlimWiseError(f"mode {mode!r} is not one of {', '.join(MODES)}")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            device = "cpu"  # lm-eval's CLI asks for cuda by default; this build has none
        model = load_model(pretrained, dtype=dtype, device=device)
        tokenizer = load_tokenizer(pretrained)
        if tokenizer is None:
            raise SlimWiseError(f"{pretrained} has no tokenizer: lm-eval works on text")
        loaded_plan = PrunePlan.load(plan) if plan else None
        decoder = None
        if decode_model:
            decoder, saved_plan = load_pruned(decode_model, dtype=dtype)
            decoder = decoder.to(device)
            loaded_plan = loaded_plan or saved_plan
        if mode != "full" and loaded_plan is None and decoder is None:
            raise SlimWiseError(f"mode {mode} needs plan=PLAN.json or decode_model=DIR in --model_args")
        if mode == "distilled" and not delta:
            raise SlimWiseError("mode distilled needs delta=DIR (the output of "
                                "`slimwise distill`) in --model_args")
        extra = {"delta": delta} if delta else {}  # only engines with distillation take it
        self.engine = PhaseSplitEngine(model, tokenizer, plan=loaded_plan, decode_model=decoder, **extra)
        self.tokenizer = tokenizer
        self.mode = mode
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_gen_toks = int(max_gen_toks)
        self._max_length = int(max_length) if max_length else int(
            getattr(model.config, "max_position_embeddings", 2048) or 2048)
        self._device = torch.device(device)

    # ----- helpers -------------------------------------------------------------------------------------
    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def prefix_token_id(self) -> int:
        """Context for an empty context (lm-eval convention): BOS if the tokenizer has one, else EOS."""
        tok = self.tokenizer
        return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    def tok_encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Tokens of context and continuation as lm-eval's HF model splits them
        (trailing spaces move over)."""
        if not context:
            return [self.prefix_token_id], self.tok_encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return whole[:len(ctx)], whole[len(ctx):]

    def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), greedy?) per pair in `self.mode`, batched by length."""
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            contexts, conts = [], []
            for i in idx:
                ctx, cont = pairs[i]
                if not cont:
                    raise SlimWiseError("an empty continuation cannot be scored")
                ctx = ctx[-max(1, self.max_length - len(cont)):]  # left-truncate, as lm-eval's HF model does
                contexts.append(ctx)
                conts.append(cont)
            logp = continuation_logprobs(self.engine, contexts, conts, self.mode)
            for row, i in enumerate(idx):
                cont = torch.tensor(conts[row], dtype=torch.long)
                lp = logp[row, :len(cont)]
                total = float(lp.gather(-1, cont[:, None]).sum())
                greedy = bool((lp.argmax(dim=-1) == cont).all())
                results[i] = (total, greedy)
        return [r for r in results if r is not None]

    # ----- lm-eval API ---------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*req.args) for req in requests]
        out = self.score(pairs)
        for req, res in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, res)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(lp for lp, _ in self.score(windows))
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences

        eos_text = self.tokenizer.decode([self.tokenizer.eos_token_id]) \
            if self.tokenizer.eos_token_id is not None \
            else None
        groups: dict[tuple, list[int]] = {}
        settings: dict[tuple, GenerationConfig] = {}
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = tuple(handle_stop_sequences(kwargs.pop("until", None), eos=eos_text))
            max_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.pop("temperature", 0.0) or 0.0) \
                if kwargs.pop("do_sample", False) else 0.0
            key = (until, max_new, temperature, float(kwargs.pop("top_p", 1.0) or 1.0))
            settings[key] = GenerationConfig(max_new_tokens=max_new, temperature=temperature, top_p=key[3],
                                             stop=until, batch_size=self.batch_size)
            groups.setdefault(key, []).append(i)
        out: list[str | None] = [None] * len(requests)
        for key, idx in groups.items():
            config = settings[key]
            budget = max(1, self.max_length - config.max_new_tokens)
            prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-budget:]
                       for i in idx]
            gens = self.engine.generate(prompts, mode=self.mode, config=config)
            for i, g in zip(idx, gens, strict=True):
                text = g.text or ""
                for stop in config.stop:  # the engine cuts at stops; cut again for safety (e.g. EOS text)
                    if stop and stop in text:
                        text = text[:text.index(stop)]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return [t or "" for t in out]


def main() -> None:
    """`python -m slimwise.evaluation.lm_eval_bridge ...`: lm-eval's own CLI with the
    `slimwise` model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
