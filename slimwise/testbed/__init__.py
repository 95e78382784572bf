"""Embedded testbed: a verifiable task suite and a tiny tokenizer for training small MoE models.

The tasks (arithmetic, lists, text) give exact answers with worked solutions, so a pruned model's decode
quality can be measured per domain without external data or large models.
"""

from slimwise.testbed.tasks import (
    ANSWER_MARKER,
    DOMAINS,
    EOS_TOKEN,
    FAMILIES,
    LEVELS,
    SPLITS,
    TARGET_DOMAIN,
    Grade,
    Sample,
    TaskFamily,
    check_disjoint,
    export_jsonl,
    families_in_domain,
    grade,
    load_jsonl,
    make_split,
    parse_answer,
    register_family,
    select_families,
    write_splits,
)
from slimwise.testbed.tokenizer import (
    PAD_TOKEN,
    build_tokenizer,
    encode_sample,
    length_stats,
    load_tokenizer,
)

__all__ = [
    "ANSWER_MARKER",
    "DOMAINS",
    "EOS_TOKEN",
    "FAMILIES",
    "LEVELS",
    "PAD_TOKEN",
    "SPLITS",
    "TARGET_DOMAIN",
    "Grade",
    "Sample",
    "TaskFamily",
    "build_tokenizer",
    "check_disjoint",
    "encode_sample",
    "export_jsonl",
    "families_in_domain",
    "grade",
    "length_stats",
    "load_jsonl",
    "load_tokenizer",
    "make_split",
    "parse_answer",
    "register_family",
    "select_families",
    "write_splits",
]
