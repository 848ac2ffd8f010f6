"""Typed service configs -> command-line flags and environment variables.

Each service describes its settings as one dataclass whose fields carry ``help`` in their
metadata; ``add_arguments`` turns the fields into ``--flags`` whose defaults may come from
``{PREFIX}{FIELD}`` environment variables (read when the command line is parsed, never at
import time), and ``from_args`` builds the dataclass, whose ``__post_init__`` checks values and
names the flag in its error. ``to_argv`` and ``secrets_env`` go back: a config to the command line
and environment that give it (``conveyor up`` starts its children so).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

from conveyor.errors import ConfigError

_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"512M"`` -> 536870912. Plain integers are bytes; K/M/G/T suffixes are powers of 1024."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = _SIZE_SUFFIXES.get(value[-1:], 1)
    number = value[:-1] if value[-1:] in _SIZE_SUFFIXES else value
    return int(float(number) * scale)


def flag(name: str) -> str:
    """A field's flag: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + name.replace("_", "-")


def setting(default, help: str, **extra):  # noqa: A002 - mirrors argparse's keyword
    """A dataclass field with a help text (and argparse extras such as ``choices``).

    ``secret=True`` marks a value that may carry a credential (API keys, a Redis URL with a password):
    ``--help`` and error messages then say whether it is set, never what it is."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


def redact(url: str) -> str:
    """A URL without its credentials (``redis://***@host:6379/0``), for logs and ``--help``."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}***@{rest.rsplit('@', 1)[1]}" if "@" in rest else url


def _shown(value, secret: bool, from_env: bool) -> str:
    """The ``--help`` text of a default: a secret's value is never printed."""
    if value is None or value == "":
        return ""
    if secret and from_env:
        return "; set from the environment (value hidden)"
    if secret:
        return "; default: " + redact(str(value)).replace("%", "%%")
    return "; default: %(default)s"


def _base_type(annotation):
    """``int | None`` -> ``int``; ``list[int]`` -> ``int`` (the field sets ``nargs``)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is list:
        return typing.get_args(annotation)[0]
    return annotation


def add_arguments(parser: argparse.ArgumentParser, cls, env_prefix: str, names: set[str] | None = None,
                  note: dict[str, str] | None = None) -> None:
    """Add one ``--flag`` per field of dataclass ``cls`` (``names``: only those); ``{env_prefix}{NAME}`` overrides
    defaults; ``note``: text appended to a field's help."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata or (names is not None and field.name not in names):
            continue  # a field not made by ``setting`` is no flag
        kind = _base_type(hints[field.name])
        env = f"{env_prefix}{field.name.upper()}"
        from_env = _from_environment(env)
        default = field.default if from_env is None else from_env
        meta = dict(field.metadata)
        secret = meta.pop("secret", False)
        help_text = (f"{meta.pop('help', '')}{(note or {}).get(field.name, '')} "
                     f"(env {env} or {env}_FILE{_shown(default, secret, from_env is not None)})")
        convert = meta.pop("parse", None) or kind
        if kind is bool:
            if isinstance(default, str):
                default = default.lower() in ("1", "true", "yes", "on")
            parser.add_argument(flag(field.name), action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        if isinstance(default, str) and convert is not str:
            default = _convert(convert, default, env, secret)
        parser.add_argument(flag(field.name), type=convert, default=default, help=help_text, **meta)


def _from_environment(env: str) -> str | None:
    """The value of ``env``, or the contents of the file ``{env}_FILE`` names (trailing newline dropped)."""
    if env in os.environ:
        return os.environ[env]
    path = os.environ.get(f"{env}_FILE")
    if not path:
        return None
    try:
        return open(path, encoding="utf-8").read().rstrip("\n")
    except OSError as exc:
        raise ConfigError(f"environment variable {env}_FILE={path}: {exc.strerror}") from exc


def _convert(convert, text: str, env: str, secret: bool = False):
    try:
        return convert(text)
    except ValueError as exc:
        if secret:
            raise ConfigError(f"environment variable {env} is not valid") from None
        raise ConfigError(f"environment variable {env}={text!r}: {exc}") from exc


def from_args(cls, namespace: argparse.Namespace):
    """Build dataclass ``cls`` from parsed arguments (its ``__post_init__`` validates)."""
    return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


def to_argv(cfg) -> list[str]:
    """The inverse of ``from_args``: the flags that give ``cfg``, for the fields that differ from their defaults,
    secrets left out (they go through the environment: ``secrets_env``)."""
    argv = []
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if value == field.default or field.metadata.get("secret"):
            continue
        if isinstance(value, bool):
            argv.append(flag(field.name) if value else "--no-" + flag(field.name)[2:])
        elif value is not None:
            argv += [flag(field.name), *(map(str, value) if isinstance(value, list) else [str(value)])]
    return argv


def secrets_env(cfg, env_prefix: str) -> dict[str, str]:
    """The secret fields of ``cfg`` that are set, as the environment variables its service reads them from."""
    return {f"{env_prefix}{f.name.upper()}": str(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)
            if f.metadata.get("secret") and getattr(cfg, f.name) != f.default}


def require(condition: bool, name: str, message: str) -> None:
    """Raise ``ConfigError`` naming ``--name`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"{flag(name)} {message}")
