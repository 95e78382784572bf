"""The testbed tokenizer: single characters plus the frequent template words, under 512 entries.

Digits are always single tokens (so column arithmetic is learnable) and random letter strings stay spelled
out letter by letter; only words that recur in the task templates ("add", " has", " blue", "Ann", ...) get
whole-word tokens, learned by counting a generated corpus. Every printable ASCII character, newline and tab
is in the vocabulary and decoding just concatenates tokens, so any ASCII text round-trips exactly. It is
saved as a plain `tokenizer.json` + `tokenizer_config.json` + `special_tokens_map.json`, which
`transformers.AutoTokenizer` (and therefore vLLM) loads as a PreTrainedTokenizerFast, except next to a
Qwen3.5/3.6-MoE config (testbed-c): there AutoTokenizer substitutes the family's Qwen3_5Tokenizer, whose own
pre-tokenizer splits the template words into characters. `slimwise.models.load_tokenizer` loads it as saved
from a model directory (PreTrainedTokenizerFast over its tokenizer.json), `load_saved_tokenizer` from a
directory without a model.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from statistics import mean

from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from slimwise.testbed.tasks import ANSWER_MARKER, EOS_TOKEN, Sample, make_split

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"  # defined for tools that want one; never added automatically
UNK_TOKEN = "<|unk|>"  # only for non-ASCII input, which the tasks never produce
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, BOS_TOKEN, UNK_TOKEN)
ALPHABET = tuple(chr(i) for i in range(32, 127)) + ("\n", "\t")
MARKER = ANSWER_MARKER.strip()  # "####" as one token
MAX_VOCAB = 512
MODEL_MAX_LENGTH = 1024

_WORD_RE = re.compile(r" ?[A-Za-z]+")


def learn_words(texts: Iterable[str], min_count: int = 20, max_words: int | None = None) -> list[str]:
    """Frequent whole letter runs, with or without one leading space, in sorted order (stable ids).

    Bare words need two letters or more (single letters already are tokens); " a" is worth keeping.
    """
    counts = Counter(m.group(0) for t in texts for m in _WORD_RE.finditer(t))
    words = [w for w, c in counts.items() if c >= min_count and len(w.strip()) >= (1 if w[0] == " " else 2)]
    words.sort(key=lambda w: (-counts[w], w))
    limit = MAX_VOCAB - len(SPECIAL_TOKENS) - len(ALPHABET) - 1 if max_words is None else max_words
    return sorted(words[:limit])


def _split_pattern(words: list[str]) -> str:
    """Regex whose matches are the pre-tokens: the marker, a known word (only as
    a whole word), or one char."""

    def alternation(ws: list[str]) -> str:
        return "|".join(sorted(ws, key=lambda w: (-len(w), w)))

    spaced = [w[1:] for w in words if w.startswith(" ")]
    bare = [w for w in words if not w.startswith(" ")]
    parts = [re.escape(MARKER)]
    if spaced:
        parts.append(f" (?:{alternation(spaced)})(?![A-Za-z])")
    if bare:
        parts.append(f"(?<![A-Za-z])(?:{alternation(bare)})(?![A-Za-z])")
    parts.append(r"[\s\S]")
    return "|".join(parts)


def corpus_texts(seed: int = 0, n_per_family: int = 200) -> list[str]:
    """Prompt+target texts of every family at both difficulty levels (train buckets only)."""
    samples = make_split("train", n_per_family, seed) + make_split(
        "train", n_per_family // 2, seed, difficulty="heldout"
    )
    return [s.text for s in samples]


CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not message['content'].endswith('\\n') %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def drop_spaced_pairs(words: list[str]) -> list[str]:
    """The word list without " word" where "word" is in it too (the qa names): the name is then one token
    wherever it stands, and the space before it stays a token of its own."""
    bare = set(words)
    return [w for w in words if not (w.startswith(" ") and w[1:] in bare)]


def build_tokenizer(
    out_dir: str | os.PathLike, seed: int = 0, n_per_family: int = 200, min_count: int = 20,
    spaced_pairs: bool = True,
) -> PreTrainedTokenizerFast:
    """Learn the word list from a generated corpus, save the tokenizer files to out_dir and reload them.

    spaced_pairs=False drops the " Name" tokens (`drop_spaced_pairs`): qa passages and questions
    spell names with a leading space and worked-solution lines without, so with both forms in the
    vocabulary copying a name from the passage into a solution line means mapping one token onto
    another; without, it is a plain copy.
    """
    words = learn_words(corpus_texts(seed, n_per_family), min_count=min_count)
    if not spaced_pairs:
        words = drop_spaced_pairs(words)
    tokens = [*SPECIAL_TOKENS, *ALPHABET, MARKER, *words]
    vocab = {t: i for i, t in enumerate(tokens)}
    assert len(vocab) == len(tokens) <= MAX_VOCAB

    tok = Tokenizer(WordLevel(vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(_split_pattern(words)), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate tokens as they are: exact round trip
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "bos_token": BOS_TOKEN, "unk_token": UNK_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        # chat requests (OpenAI /v1/chat/completions) become the task's plain prompt: content + newline
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return load_saved_tokenizer(out)


def load_saved_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """The tokenizer files of a directory that need not hold a model (a run directory before its first
    checkpoint, the builder's output), as saved. A model directory's tokenizer is `slimwise.models.
    load_tokenizer`'s: the same object for these files, but that one resolves a model first."""
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def encode_sample(tokenizer: PreTrainedTokenizerFast, sample: Sample) -> tuple[list[int], list[int]]:
    """(prompt ids, target ids + EOS): the model is trained on the target part only."""
    prompt = tokenizer.encode(sample.prompt, add_special_tokens=False)
    target = tokenizer.encode(sample.target, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt, target


def length_stats(
    samples: Iterable[Sample], tokenizer: PreTrainedTokenizerFast
) -> dict[str, dict[str, float]]:
    """Per family: count and mean prompt / target (with EOS) / total tokens, and the longest total."""
    per: dict[str, list[tuple[int, int]]] = {}
    for s in samples:
        p, t = encode_sample(tokenizer, s)
        per.setdefault(s.family, []).append((len(p), len(t)))
    return {
        fam: {
            "n": len(v),
            "prompt": mean(p for p, _ in v),
            "target": mean(t for _, t in v),
            "total": mean(p + t for p, t in v),
            "max_total": max(p + t for p, t in v),
        }
        for fam, v in per.items()
    }


def format_length_stats(stats: dict[str, dict[str, float]]) -> str:
    lines = [f"{'family':<10}{'n':>6}{'prompt':>8}{'target':>8}{'total':>8}{'max':>6}"]
    for fam, s in stats.items():
        lines.append(
            f"{fam:<10}{s['n']:>6}{s['prompt']:>8.1f}{s['target']:>8.1f}{s['total']:>8.1f}{s['max_total']:>6}"
        )
    return "\n".join(lines)
