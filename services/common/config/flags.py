"""Command-line flags derived from configuration dataclasses.

A config field declared with `option(default, help)` becomes the flag `--field-name`; its type
annotation gives the parser (int, float, str; bool becomes --flag / --no-flag), and `choices`,
extra `aliases` and `env` variables come from the same declaration. So a CLI never repeats a
default or a help text, and `from_args` builds the frozen config, which validates itself.

    parser = argparse.ArgumentParser()
    add_flags(parser, EngineConfig, exclude=("model",))
    config = from_args(EngineConfig, parser.parse_args())
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Collection, Mapping
from typing import Any


def option(default: Any, help: str, *, choices: Collection[str] | None = None,
           flag: str | None = None, aliases: tuple[str, ...] = ()) -> Any:
    """A dataclass field with its command-line documentation; `flag` replaces the name
    `--field-name`, `aliases` add names. Fields declared plainly are never flags (secrets,
    values only programs set)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": tuple(choices) if choices else None, "flag": flag,
        "aliases": aliases})


def flag_fields(cls: type, include: Collection[str] | None = None,
                exclude: Collection[str] = ()) -> list[dataclasses.Field]:
    """The fields of `cls` declared with `option`."""
    fields = []
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata or f.name in exclude:
            continue
        if include is not None and f.name not in include:
            continue
        fields.append(f)
    return fields


def _parser_type(annotation: object) -> type:
    text = str(annotation)
    for name, kind in (("bool", bool), ("float", float), ("int", int)):
        if name in text.replace("None", ""):
            return kind
    return str


def field_kind(f: dataclasses.Field) -> type:
    """The Python type a field's values have: bool, float, int or str."""
    return _parser_type(f.type)


def env_value(f: dataclasses.Field, env_prefix: str,
              environ: Mapping[str, str] | None = None) -> tuple[bool, Any]:
    """(True, value) when PREFIX_FIELD_NAME is set in `environ` (default os.environ), parsed
    by the field's type (bool: 1/true/yes); else (False, None). Raises ValueError naming the
    variable for a value that does not parse."""
    environ = os.environ if environ is None else environ
    env_name = env_prefix + f.name.upper()
    if env_name not in environ:
        return False, None
    raw, kind = environ[env_name], field_kind(f)
    try:
        return True, raw.lower() in ("1", "true", "yes") if kind is bool else kind(raw)
    except ValueError:
        raise ValueError(f"environment {env_name}={raw!r}: not a valid "
                         f"{kind.__name__}") from None


def env_values(cls: type, env_prefix: str,
               environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """{field name: value} of the `option` fields of `cls` set in the environment."""
    values = {}
    for f in flag_fields(cls):
        present, value = env_value(f, env_prefix, environ)
        if present:
            values[f.name] = value
    return values


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *,
              defaults: Mapping[str, Any] | None = None, env_prefix: str | None = None,
              include: Collection[str] | None = None, exclude: Collection[str] = ()) -> None:
    """Adds a flag for every `option` field of `cls`. `defaults` overrides the dataclass's
    defaults for this command; with `env_prefix`, PREFIX_FIELD_NAME in the environment
    overrides those, and a flag on the command line overrides everything."""
    defaults = dict(defaults or {})
    for f in flag_fields(cls, include, exclude):
        kind = field_kind(f)
        default = defaults.get(f.name, f.default)
        names = [f.metadata["flag"] or "--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
        env_help = ""
        if env_prefix is not None:
            env_help = f"; env {env_prefix + f.name.upper()}"
            present, value = env_value(f, env_prefix)
            if present:
                default = value
        help_text = f"{f.metadata['help']} (default {default}{env_help})"
        if kind is bool:
            parser.add_argument(*names, dest=f.name, default=default, help=help_text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(*names, dest=f.name, default=default, type=kind,
                                choices=f.metadata["choices"], help=help_text,
                                metavar=None if f.metadata["choices"]
                                else names[0].lstrip("-").replace("-", "_").upper())


def flag_values(cls: type, args: argparse.Namespace, include: Collection[str] | None = None,
                exclude: Collection[str] = ()) -> dict[str, Any]:
    """{field name: parsed value} of the flags `add_flags` added for `cls`."""
    return {f.name: getattr(args, f.name) for f in flag_fields(cls, include, exclude)}


def from_args(cls: type, args: argparse.Namespace, include: Collection[str] | None = None,
              exclude: Collection[str] = (), **values: Any) -> Any:
    """`cls` from the parsed flags of its fields, plus `values` for fields set otherwise.
    Raises ValueError (from the config's own checks) for a bad combination."""
    return cls(**{**flag_values(cls, args, include, exclude), **values})
