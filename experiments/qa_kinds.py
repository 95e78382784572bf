"""Where a testbed model fails the qa family, by question kind and by step of the worked solution.

A qa solution copies every fact of the passage as a line `Name color animal yes|no` (yes on the fact the
question asks about), then reads the answer off the yes line: `#### color` for "what color is X's animal?",
`#### Name` for "who has the color animal?", `#### animal` for "what pet does X have?". For each kind this
counts, on the test split (greedy, bfloat16 as shipped, or --dtype float32 where bf16 is emulated): the right
answer; every fact line copied right; every yes/no mark right; and the problems whose marks are all right but
whose answer is wrong (the read-off step failed).

  python -m experiments.qa_kinds lab/testbed/checkpoints/qwen3_5moe-c runs/testbed-c4 --n 100
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from slimwise.models import load_model, load_tokenizer
from slimwise.testbed import make_split

KINDS = {"what color": "color", "who has": "who", "what pet": "pet"}


def kind_of(prompt: str) -> str:
    question = prompt.split("Q: ", 1)[1]
    return next(k for prefix, k in KINDS.items() if question.startswith(prefix))


def qa_kinds(model_dir: str, n: int = 100, seed: int = 0, max_new_tokens: int = 48,
             dtype: str = "bfloat16") -> dict[str, Counter]:
    """Counters per kind: n, answer, facts, marks, readoff_failed."""
    model, tok = load_model(model_dir, dtype=dtype), load_tokenizer(model_dir)
    counts: dict[str, Counter] = {k: Counter() for k in KINDS.values()}
    for s in make_split("test", n, seed=seed, families=["qa"]):
        ids = tok(s.prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        want = s.target.split("\n")[:-1]
        got = text.split("\n")[:len(want)]
        c = counts[kind_of(s.prompt)]
        answer = text.strip().split("\n")[-1] == f"#### {s.answer}"
        marks = [line.split()[-1:] for line in got] == [line.split()[-1:] for line in want]
        c.update(
            n=1,
            answer=answer,
            facts=[line.split()[:3] for line in got] == [line.split()[:3] for line in want],
            marks=marks,
            readoff_failed=marks and not answer,
        )
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--n", type=int, default=100, help="qa test problems (seed 0, the model card's sample)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="float32 where the CPU has no bf16 units (4x faster there; answers within noise)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(
        "| model | kind | problems | answer right | facts copied right | yes/no marks right | marks "
        "right, answer wrong |"
    )
    print("|---|---|---|---|---|---|---|")
    for path in args.models:
        for kind, c in qa_kinds(path, args.n, dtype=args.dtype).items():
            print(
                f"| {path} | {kind} | {c['n']} | {c['answer']} | {c['facts']} | {c['marks']} | "
                f"{c['readoff_failed']} |"
            )


if __name__ == "__main__":
    main()
