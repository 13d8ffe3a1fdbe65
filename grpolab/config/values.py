"""A YAML or command-line value read as its config field's declared type (``coerce``), and the
error for a key no config has."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

import yaml

from grpolab.config import yamlsafe
from grpolab.config.schema import ConfigError, field_types
from grpolab.config.speed import Speed


def unknown_key(name: str, known: list[str], command: str = "workshop") -> ConfigError:
    """The error for a key no config has, naming the closest of ``known`` or the help."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"grpolab {command} --help lists them"
    return ConfigError(f"unknown config key {name!r} ({hint})")


def coerce(name: str, value: Any) -> Any:
    """Convert a YAML or command-line value to the field's declared type, or raise ConfigError."""
    types_ = field_types()
    if name not in types_:
        raise unknown_key(name, list(types_))
    tp = types_[name]
    try:
        return _as(tp, value)
    except ConfigError:
        raise
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or "invalid YAML"
        raise ConfigError(f"config key {name!r}: YAML refused: {problem}") from None
    except (TypeError, ValueError):
        raise ConfigError(f"config key {name!r}: cannot read {value!r} as {_type_name(tp)}") from None


def _as(tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    if tp is bool:
        if isinstance(value, bool):
            return value
        s = str(value).strip().lower()
        if s in ("1", "true", "yes", "on"):
            return True
        if s in ("0", "false", "no", "off"):
            return False
        raise ValueError(value)
    if tp in (int, float, str):
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        if isinstance(value, bool) if tp is not str else isinstance(
                value, (bool, dict, list, tuple, set)):  # (a mapping is no text: refused)
            raise ValueError(value)
        return "" if tp is str and value is None else tp(value)  # null: none (answer_column)
    if tp is Speed:
        return _speed(value)
    if origin is list:
        (inner,) = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ValueError(value)
        return [inner(v.strip() if isinstance(v, str) else v) for v in value]
    if origin is dict:
        if isinstance(value, str):
            # (--task-config '{...}'): aliases bounded as in a config file
            value = yamlsafe.safe_load(value) if value.strip() else {}
        if not isinstance(value, dict):
            raise ValueError(value)
        return {str(k): v for k, v in value.items()}
    if origin is Literal:
        return str(value)
    if origin in (types.UnionType, typing.Union):
        return value
    return value


def _speed(value: Any) -> Speed:
    """A Speed from itself, a mapping, or ``key=value,key=value`` (the command line)."""
    if isinstance(value, Speed):
        return dataclasses.replace(value)
    if isinstance(value, str):
        pairs = [p.partition("=") for p in value.split(",") if p.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError(value)
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if not isinstance(value, dict):
        raise TypeError(value)
    known = {f.name for f in dataclasses.fields(Speed)}
    bad = [k for k in value if k not in known]
    if bad:
        raise ConfigError(f"speed: unknown option {bad[0]!r}; known: {', '.join(sorted(known))}")
    return Speed(**{k: _as(bool, v) for k, v in value.items()})


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
