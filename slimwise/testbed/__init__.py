"""Embedded testbed: a verifiable task suite for the small MoE models SlimWise ships.

The tasks (arithmetic, lists, text) give exact answers with worked solutions, so a pruned model's decode
quality can be measured per domain without external data or large models (`slimwise eval`, `slimwise demo`).
Training the models and building their tokenizer is the lab's (lab.testbed), outside the installed package.
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

__all__ = [
    "ANSWER_MARKER",
    "DOMAINS",
    "EOS_TOKEN",
    "FAMILIES",
    "LEVELS",
    "SPLITS",
    "TARGET_DOMAIN",
    "Grade",
    "Sample",
    "TaskFamily",
    "check_disjoint",
    "export_jsonl",
    "families_in_domain",
    "grade",
    "load_jsonl",
    "make_split",
    "parse_answer",
    "register_family",
    "select_families",
    "write_splits",
]
