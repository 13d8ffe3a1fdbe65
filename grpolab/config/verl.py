"""verl's names for grpolab's settings: a verl run script's overrides (``data.train_batch_size=32
actor_rollout_ref.rollout.n=8 ...``, as ``grpolab train`` arguments or dotted YAML keys) or verl's
nested YAML, read as verl 0.9.1 means them. ``from_verl`` translates: one-to-one keys
(``verl_fields.VERL_ALIASES``), keys verl reads together (the batch and its mini-batches, the KL
term, the advantage estimator, the policy loss, the rewards, the schedule), keys left aside
because nothing trained changes (one notice), and the rest refused in one line.
``unset_defaults`` names verl's defaults a config leaves at grpolab's. The rules themselves:
``grpolab.config.verl_rules``."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

from grpolab.config.schema import ConfigError
from grpolab.config.values import coerce
from grpolab.config.verl_fields import (
    VAL_KWARGS,
    VERL_ALIASES,
    VERL_ASIDE,
    VERL_COMBINED,
    VERL_DEFAULTS_DIFFER,
    VERL_ROOTS,
    A,
    R,
)
from grpolab.config.verl_rules import RULES

log = logging.getLogger("grpolab")


def is_verl(key: str) -> bool:
    return "." in key and key.split(".", 1)[0] in VERL_ROOTS


def flatten(given: dict[str, Any]) -> dict[str, Any]:
    """verl's nested YAML (``actor_rollout_ref: {actor: {optim: {lr: ...}}}``) as dotted keys;
    Hydra's ``+key`` as ``key``; other keys as they are."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for key, value in given.items():
        key = str(key).lstrip("+")
        if key.split(".", 1)[0] in VERL_ROOTS and isinstance(value, dict):
            walk(key, value)
        else:
            out[key] = value
    return out


def from_verl(given: dict[str, Any], later: dict[str, Any] | None = None,
              earlier: dict[str, Any] | None = None, command: str = "train",
              under: bool = False) -> dict[str, Any]:
    """Translate the verl keys of ``given`` (other keys pass unchanged). ``earlier`` (a YAML
    file) and ``later`` (overrides) are read where verl combines keys, as ``from_trl`` does;
    a verl key and the grpolab key it sets that disagree are an error. ``command``: verl's
    validation sampling (``rollout.val_kwargs``) is read by ``eval`` only. ``under``: the
    peer's defaults, under every layer, read with them (``later``) in each rule they touch."""
    given = flatten(given)
    if not any(is_verl(k) for k in given):
        return given
    later, earlier = flatten(later or {}), flatten(earlier or {})
    d = {**earlier, **given, **later}
    d = {k: v for k, v in d.items() if v is not None}  # (Hydra's key=null: unset)
    if "steps" in later:  # a later length is the run's (the warm-up ratio reads it)
        d["trainer.total_training_steps"] = later["steps"]
    elif "passes" in later:
        d.pop("trainer.total_training_steps", None)
    if "passes" in earlier and "passes" not in given.keys() | later.keys():
        d.pop("passes", None)  # (a file's passes: a later total_epochs replaces them)
    mode = A + "policy_loss.loss_mode"  # (a later layer's loss_mode replaces a file's
    if "policy_loss" in earlier.keys() - given.keys() - later.keys() and mode in given | later:
        d.pop("policy_loss")  # policy_loss: its dual clip and mean are verl's loss's)
    for layer in (later, given, earlier):  # the group size the run ends with
        g = next((layer[k] for k in (R + "n", "group_size", "num_generations") if k in layer), None)
        if g is not None:
            d["__group"] = g
            break
    d["__command"] = command
    out = {k: v for k, v in given.items() if not is_verl(k)}
    source: dict[str, str] = {}

    def put(key: str, value: Any, verl_key: str) -> None:
        try:
            coerce(key, value)
        except ConfigError as e:
            raise ConfigError(f"{verl_key}={d.get(verl_key)!r} (verl, grpolab's {key}): {e}"
                              ) from None
        if key in out and out[key] != value and key not in source:
            raise ConfigError(f"{verl_key}={d.get(verl_key)!r} (verl) sets {key} to {value!r}, "
                              f"but {key} sets it to {out[key]!r}; keep one of them")
        out[key] = value
        source.setdefault(key, verl_key)

    mine = [k for k in given if is_verl(k) and k not in later]
    aside = []
    for key in mine:
        if key in VERL_ALIASES:
            if key in d:  # (null: grpolab's default)
                put(VERL_ALIASES[key], d[key], key)
        elif key.startswith(VERL_ASIDE) and not (command == "eval" and key in VAL_KWARGS):
            aside.append(key)
        elif key not in VERL_COMBINED:
            near = difflib.get_close_matches(key, [*VERL_ALIASES, *VERL_COMBINED], n=1, cutoff=0.8)
            if near:  # (a misspelt key, most likely)
                raise ConfigError(f"{key}={given[key]!r} (verl): no such key grpolab reads; did "
                                  f"you mean {near[0]}?")
            raise ConfigError(f"{key}={given[key]!r} (verl) has no grpolab equivalent; remove "
                              "it (or ask for it: it changes what is trained)")
    touched = set(mine)
    for keys, rule in RULES:  # (a rule the overrides touch too is read with them, there)
        if touched & set(keys) and (under or not later.keys() & set(keys)):
            try:
                said = rule(d)
            except ConfigError:
                raise
            except (ValueError, TypeError) as e:  # (a value the rule could not read: named
                mine = ", ".join(f"{k}={d[k]!r}" for k in keys if k in touched)  # with its keys)
                raise ConfigError(f"{mine} (verl): cannot be read ({e})") from None
            for key, value in said.items():
                put(key, value, next(k for k in keys if k in touched))
    if aside:
        log.warning("verl settings left aside (they change nothing that is trained here): %s",
                    ", ".join(sorted(aside)))
    return out


def unset_defaults(given: set[str] | Any, cfg: Any) -> list[str]:
    """``VERL_DEFAULTS_DIFFER``'s entries none of ``given`` sets, as "grpolab's (verl's)"."""
    shown = {k: str(v).lower() if isinstance(v, bool) else v for k, v in vars(cfg).items()}
    moot = {"std": cfg.estimator != "grpo" or cfg.scale != "std",  # (no std division)
            "dual_clip": cfg.policy_loss != "clip",  # (verl's dual clip: vanilla's only)
            "prompt_order": cfg.prompt_order == "epochs"}  # (verl's order)
    return [f"{ours.format_map(shown)} ({theirs})" for ours, theirs, keys, _ in VERL_DEFAULTS_DIFFER
            if not set(given) & set(keys) and not moot.get(ours.split()[0])]


def resume_from(keys: dict[str, Any], out_dir: Path, holds_checkpoint: bool) -> bool:
    """verl's ``trainer.resume_mode`` among a run's ``keys`` (a file's, then the overrides'),
    as ``--resume``: ``auto`` continues ``out_dir``'s run when it holds a checkpoint (verl's
    default, here only when given), ``resume_path`` continues the run whose folder (or its
    ``checkpoints/`` or last checkpoint) ``resume_from_path`` names, which must be ``out_dir``'s
    (grpolab resumes its own run, from its last checkpoint)."""
    d = flatten(keys)
    mode = str(d.get("trainer.resume_mode", "disable")).lower()
    if mode == "auto":
        return holds_checkpoint
    if mode != "resume_path":
        return False
    path = Path(str(d.get("trainer.resume_from_path"))).expanduser().resolve()
    if not names_the_run(path, out_dir):
        raise ConfigError(f"trainer.resume_from_path={path} (verl): grpolab continues the run "
                          f"in out_dir ({out_dir}) from its last checkpoint: name that folder")
    return True


def names_the_run(path: Path, out_dir: Path) -> bool:
    """Whether ``path`` (resolved) is out_dir, its ``checkpoints/`` or its last checkpoint: what
    a resume may name, as grpolab continues a run from its last checkpoint only."""
    run = out_dir.expanduser().resolve()
    return path in (run, run / "checkpoints", run / "checkpoints" / "last.pt")
