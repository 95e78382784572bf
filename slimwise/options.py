"""Command-line options generated from config dataclasses, so each option's default, type and help are
declared once: on the config field, as `field(default=..., metadata={"help": ..., ...})`.

A field is an option when its metadata has "help" (None for an option without help text). Other metadata keys:
  flag     the option string when it is not --field-name (--out for out_dir), or a bare name for a positional;
           a bool field defaulting to True gets --no-field-name
  type, choices, metavar, nargs, action, const, required   passed to `add_argument` as they are
  convert  turns the parsed value into the field's value (GiB into bytes, a list into a tuple); such an
           option, and an `append` one, defaults to None on the command line: the field keeps its default
  render   the inverse of convert, for `argv_of`: the field's value -> its arguments (one per
           occurrence of an `append` option)
The option's default is the field's default. A bool field is a flag that flips its field's default. The parsed
value lands where argparse puts it (the flag's name: args.out, args.no_kl); `config_from_args` maps it back.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

#: metadata keys handed to `add_argument` unchanged
PASSED = ("type", "choices", "metavar", "nargs", "action", "const", "required")


def option_fields(config_cls) -> dict[str, dataclasses.Field]:
    """The fields of `config_cls` that are command-line options, by name, in declaration order."""
    return {f.name: f for f in dataclasses.fields(config_cls) if "help" in f.metadata}


def add_dataclass_options(parser: argparse.ArgumentParser, config_cls, names: Iterable[str] | None = None, *,
                          exclude: Iterable[str] = (),
                          overrides: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """Add the options of `config_cls` to `parser`: those in `names` in that order (every option field, in
    declaration order, when None), less `exclude`. `overrides` maps a field name to `add_argument` keywords
    that replace the generated ones (a command line's own default, say)."""
    fields = option_fields(config_cls)
    skip = set(exclude)
    for name in fields if names is None else names:
        if name in skip:
            continue
        if name not in fields:
            raise ValueError(f"{config_cls.__name__}.{name} is not a command-line option "
                             "(no help in its metadata)")
        f = fields[name]
        parser.add_argument(flag_of(f), **{**_keywords(f), **(overrides or {}).get(name, {})})


def config_from_args(config_cls, args: argparse.Namespace, **explicit):
    """`config_cls` from the parsed options that `add_dataclass_options` added. `explicit` values win; a field
    whose option is not on this parser (or was not given and defaults to None there) keeps its default."""
    return config_cls(**values_from_args(config_cls, args, skip=explicit), **explicit)


def values_from_args(config_cls, args: argparse.Namespace, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The field values `config_from_args` passes to `config_cls` (without constructing it, so without its
    checks): one per option field on this parser, less `skip`, whose parsed value is not None (a flag's
    always)."""
    values = {}
    for name, f in option_fields(config_cls).items():
        dest = dest_of(f)
        if name in skip or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        if _is_flag(f):
            values[name] = (not _default(f)) if value else _default(f)
        elif value is not None:
            convert = f.metadata.get("convert")
            values[name] = convert(value) if convert else value
    return values


def default_of(f: dataclasses.Field) -> Any:
    """A field's default (its default factory's value); MISSING for a field without one."""
    return _default(f)


def argv_of(config_cls, values: Mapping[str, Any], names: Iterable[str] | None = None, *,
            always: Iterable[str] = ()) -> list[str]:
    """The inverse of `add_dataclass_options` + `config_from_args`: arguments that parse back to `values` (a
    config's fields as `dataclasses.asdict` gives them; a missing field has its default). One option per field
    of `names` (every option field when None), in that order, that differs from its default or is in `always`;
    None is left out (no command line spells it). Raises ValueError for a field with `convert` and no
    `render`."""
    fields, keep = option_fields(config_cls), set(always)
    argv: list[str] = []
    for name in fields if names is None else names:
        f = fields[name]
        default = _default(f)
        value = values.get(name, default)
        if value is None or (value == default and name not in keep):
            continue
        flag = flag_of(f)
        if _is_flag(f):
            argv += [flag] if value != default else []
            continue
        if "render" in f.metadata:
            words = [argument_text(w) for w in f.metadata["render"](value)]
        elif "convert" in f.metadata:
            raise ValueError(f"{config_cls.__name__}.{name} converts its option: give it a render")
        else:
            many = f.metadata.get("action") == "append" or f.metadata.get("nargs") in ("*", "+")
            words = [argument_text(v) for v in value] if many else [argument_text(value)]
        head = [flag] if flag.startswith("-") else []
        if f.metadata.get("nargs") in ("*", "+"):  # one flag, then every value
            argv += [*head, *words]
        else:  # an `append` option repeats its flag
            for word in words:
                argv += [*head, word]
    return argv


def command_of(program: str, argv: Iterable[str]) -> str:
    """`program` and `argv` as one shell line (each argument quoted where the shell needs it)."""
    return " ".join([program, shlex.join(argv)]).rstrip()


def argument_text(value: Any) -> str:
    """A value as its option's argument: floats in their shortest exact form (60.0 -> 60, 0.001 -> 0.001)."""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else repr(value)
    return str(value)


def flag_of(f: dataclasses.Field) -> str:
    """The option string of an option field (a bare name for a positional)."""
    if "flag" in f.metadata:
        return f.metadata["flag"]
    stem = f.name.replace("_", "-")
    return f"--no-{stem}" if _is_flag(f) and _default(f) is True else f"--{stem}"


def dest_of(f: dataclasses.Field) -> str:
    """Where argparse stores the option's value: the flag's name, as argparse derives it."""
    return flag_of(f).lstrip("-").replace("-", "_")


def _keywords(f: dataclasses.Field) -> dict[str, Any]:
    meta = f.metadata
    kw = {key: meta[key] for key in PASSED if key in meta}
    kw["help"] = meta["help"]
    if _is_flag(f):
        kw["action"] = "store_true"
    elif "convert" in meta or kw.get("action") == "append":
        kw["default"] = None
    elif f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
        kw["default"] = _default(f)
    return kw


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _is_flag(f: dataclasses.Field) -> bool:
    return f.type in (bool, "bool") and "action" not in f.metadata
