"""Reading a config: defaults (the command's), then a YAML file, then overrides (flags or
keyword arguments), each TRL or verl name translated (``grpolab.config.trl``,
``grpolab.config.verl``); resolved and validated."""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import yaml

from grpolab.config import trl, verl, yamlsafe
from grpolab.config.schema import COMMANDS, Config, ConfigError, command_defaults, field_types
from grpolab.config.trl_values import as_word
from grpolab.config.validate import resolve
from grpolab.config.values import coerce, unknown_key
from grpolab.config.verl_fields import A
from grpolab.core.losses import POLICY_LOSSES, policy_knobs

log = logging.getLogger("grpolab")
LOSS_MODE = A + "policy_loss.loss_mode"  # (verl's name for policy_loss)
# each policy loss's settings, and the losses that read them
IDLE_KNOBS = {k: ", ".join(n for n in POLICY_LOSSES if k in policy_knobs(n))
              for n in POLICY_LOSSES for k in policy_knobs(n)}


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yamlsafe.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "invalid YAML"
        what = "YAML refused" if isinstance(e, yamlsafe.YAMLTooLarge) else "broken YAML"
        raise ConfigError(f"{what} in {p}{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p} must hold a mapping of keys to values")
    return data


def make_config(yaml_path: str | Path | dict[str, Any] | None = None,
                overrides: dict[str, Any] | None = None, command: str = "workshop",
                strict: bool = False) -> Config:
    """The command's defaults, then the YAML file (or a dict of its keys), then overrides;
    resolved and validated.

    TRL's names for the same settings (``TRL_ALIASES``, ``num_generations: 8``,
    ``loss_type: dapo``...) are accepted in either and translated first (``from_trl``); for
    ``train`` one warning names the grpolab defaults, not TRL's, that a TRL config leaves in
    place. Rewards overridden without weights drop the file's weights (one line says so).
    A file's settings of other commands are warned of (``out_of_scope``); ``strict`` (the CLI's
    flags, the API's keywords) refuses the overrides' in one line.
    """
    kwargs: dict[str, Any] = dict(command_defaults(command))
    later = _names({k: v for k, v in (overrides or {}).items()  # (verl's key=null: unset)
                    if v is not None or verl.is_verl(str(k).lstrip("+"))})
    _known(later, command)
    idle = out_of_scope(later, command) if strict else None  # (flags, keywords: this command's)
    if idle:
        raise ConfigError(idle)
    given_file = isinstance(yaml_path, (str, Path)) and bool(yaml_path)
    earlier = _names(load_yaml(yaml_path) if given_file else yaml_path or {})
    peer = later.get("defaults", earlier.get("defaults"))  # (exactly: another is refused)
    if peer not in ("grpolab", "trl", "verl") and "defaults" in later.keys() | earlier.keys():
        where = f"{yaml_path}: " if given_file and "defaults" not in later else ""
        raise ConfigError(f"{where}defaults must be grpolab, trl or verl (got {peer!r})")
    covered: set[str] = set()  # (the keys whose defaults the peer's gave: not warned of)
    base: dict[str, Any] = {}
    if peer in ("trl", "verl") and command in ("train", "eval"):  # (the command's defaults)
        base, covered = peer_defaults(peer, earlier.keys() | later.keys())
    try:
        _known(earlier, command)
        from_file = _read(earlier, later=later, command=command)
    except ConfigError as e:
        if not given_file:
            raise
        raise ConfigError(f"{yaml_path}: {e}") from None  # the user has to find the bad line
    ours = _read(later, earlier=earlier, command=command)
    if base:  # (under the file and the overrides, read once both are: with them)
        kwargs.update(_peer_values(str(peer), base, earlier, later, command))
    kwargs.update(from_file)
    idle = out_of_scope(from_file, command, changed=True) if command != "eval" else None
    if idle:  # (a file may serve several commands; eval reads its training's)
        log.warning("%s%s", f"{yaml_path}: " if given_file else "", idle)
    file_rewards = kwargs.get("rewards", Config.__dataclass_fields__["rewards"].default_factory())
    idle = out_of_scope(ours, command) if strict else None  # (TRL's, verl's names too)
    theirs = [k for k in later if k not in Config.__dataclass_fields__]
    if idle and command == "eval" and theirs and all(verl.is_verl(k) for k in theirs):
        log.warning("%s: a verl script's settings, left aside", idle)  # (its whole script)
    elif idle:
        raise ConfigError(f"{idle} (read from {', '.join(theirs)})" if theirs else idle)
    if ("rewards" in ours and "reward_weights" not in ours and kwargs.get("reward_weights")
            and ours["rewards"] != file_rewards):
        # the file's weights were for its own rewards: they no longer pair with these
        log.warning("the overrides' rewards replace the config's, so its reward_weights %s are "
                    "dropped (each reward weighs 1)", kwargs.pop("reward_weights"))
    if "steps" in ours and "passes" not in ours:  # a later length replaces a file's passes
        kwargs["passes"] = 0.0
    kwargs.update(ours)
    if (from_file.get("passes") or ours.get("passes")) and (  # (passes given: also when a
            "prompt_order" not in from_file.keys() | ours.keys()):  # later steps replace them)
        kwargs["prompt_order"] = "epochs"  # a pass shows each prompt once, as TRL's and verl's
    cfg = resolve(Config(**kwargs))
    if command == "train":  # (the workshop warns per run: a sweep's variants change them)
        warn_idle(cfg)
    given = earlier.keys() | later.keys() | covered
    if command == "train" and given & trl.TRL_KEYS and peer != "verl":  # (the other's chosen)
        left = trl.unset_defaults(given, cfg)
        if left:
            log.warning("this TRL config leaves these at grpolab's defaults, not TRL's: %s",
                        ", ".join(left))
    if command == "train" and any(verl.is_verl(k) for k in given) and peer != "trl":
        left = verl.unset_defaults(given, cfg)
        if left:
            log.warning("this verl config leaves these at grpolab's defaults, not verl 0.9.1's: "
                        "%s", ", ".join(left))
    return cfg


def peer_defaults(peer: str, given: set[str] | Any) -> tuple[dict[str, Any], set[str]]:
    """``defaults: trl`` / ``verl``: the peer's values (in its names) of the settings whose
    defaults differ from grpolab's (``TRL_DEFAULTS_DIFFER``, ``VERL_DEFAULTS_DIFFER``), read as
    the command's defaults under the file and the overrides, and the keys they cover (not
    warned of). A given length or evaluation replaces the peer's whole; verl's rollout.n 1 (its
    PPO's) is not taken where an estimator is named (a group of one has no baseline)."""
    table = trl.TRL_DEFAULTS_DIFFER if peer == "trl" else verl.VERL_DEFAULTS_DIFFER
    estimator = bool({"algorithm.adv_estimator", "estimator"} & set(given))
    base: dict[str, Any] = {}
    covered: set[str] = set()
    for ours, _, keys, theirs in table:
        name = ours.split()[0]
        if (name in ("steps", "eval_every") and set(given) & set(keys)
                or name == "group_size" and estimator or not theirs):
            continue
        base.update(theirs)
        covered |= set(keys)
    return base, covered - {k for _, _, keys, theirs in table if not theirs for k in keys}


def _peer_values(peer: str, base: dict[str, Any], earlier: dict[str, Any],
                 later: dict[str, Any], command: str) -> dict[str, Any]:
    """The peer's defaults as grpolab's settings, read with what the file (``earlier``) and the
    overrides (``later``) give, which win, where the peer combines keys: verl's default
    train_batch_size times a rollout.n given, its default clip_ratio_c as the policy loss the
    run ends with reads it, TRL's default loss_type dapo with a steps_per_generation given, its
    save_steps 500 in optimiser steps at a num_iterations given."""
    above = {**earlier, **later}
    if "policy_loss" in earlier.keys() - later.keys() and LOSS_MODE in later:  # (a later
        del above["policy_loss"]  # loss_mode replaces a file's policy_loss, as from_verl reads)
    above = {k: v for k, v in above.items() if v is not None or not verl.is_verl(k)}  # (verl's
    base = {k: v for k, v in base.items() if k not in above}  # key=null: unset, the peer's)
    said = _ThisThreadsVerlRules()  # (what verl's rules warn of is a key given, which its
    log.addFilter(said)  # own reading has said: not twice)
    try:
        values = _read(base, later=above, command=command, under=True)
    except ConfigError as e:
        raise ConfigError(f"defaults: {peer}: {e}; or set it in the config") from None
    finally:
        log.removeFilter(said)
    return {k: v for k, v in values.items()
            if command in Config.__dataclass_fields__[k].metadata["commands"]}


class _ThisThreadsVerlRules(logging.Filter):
    """Drops the warnings of verl's rules (``verl_rules``) logged by the thread that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.thread == self.thread and record.module == "verl_rules")


def warn_idle(cfg: Config, where: str = "") -> None:
    """One warning for each kind of setting the run changed but does not read: another policy
    loss's, ``off_policy_mask`` with one epoch (pi = pi_old there: nothing is masked), the
    adaptive entropy controller's without it, ``token_mean_by`` with one step or no token mean,
    the value model's without ``estimator: ppo``."""
    idle = sorted(k for k in IDLE_KNOBS if k not in policy_knobs(cfg.policy_loss)
                  and getattr(cfg, k) != Config.__dataclass_fields__[k].default)
    if idle:
        log.warning("%spolicy_loss %s does not read %s (%s)", where, cfg.policy_loss,
                    ", ".join(idle), "; ".join(f"{k}: {IDLE_KNOBS[k]}" for k in idle))
    if cfg.off_policy_mask > 0 and cfg.epochs == 1 and cfg.minibatches == 1:
        log.warning("%soff_policy_mask acts only with epochs > 1 (TRL num_iterations) or "
                    "minibatches > 1: with one optimiser step the policy is the one that "
                    "sampled, and nothing is masked", where)
    knobs = ("entropy_target", "entropy_coef_delta", "entropy_coef_min", "entropy_coef_max")
    moved = [k for k in knobs if getattr(cfg, k) != Config.__dataclass_fields__[k].default]
    if moved and not cfg.use_adaptive_entropy:
        log.warning("%s%s act only with use_adaptive_entropy", where, ", ".join(moved))
    if (cfg.min_lr_rate or cfg.min_lr) and cfg.lr_schedule != "cosine":
        log.warning("%smin_lr_rate and min_lr act only with lr_schedule cosine", where)
    critic = [k for k in ("critic_lr", "critic_warmup", "value_clip", "value_agg", "lam")
              if getattr(cfg, k) not in {command_defaults(c).get(k, Config.__dataclass_fields__[
                  k].default) for c in COMMANDS}]
    if critic and cfg.estimator != "ppo":
        log.warning("%s%s act%s only with estimator ppo (the value model's)", where,
                    ", ".join(critic), "s" if len(critic) == 1 else "")
    token_mean = "token_mean" in (cfg.loss_agg, cfg.policy_agg)
    if cfg.token_mean_by == "batch" and (cfg.minibatches == 1 or not token_mean):
        log.warning("%stoken_mean_by batch acts only with minibatches > 1 and a token_mean "
                    "loss_agg: one optimiser step a batch divides by its own tokens", where)


def _known(given: dict[str, Any], command: str) -> None:
    """Every key is grpolab's, TRL's or verl's (``from_verl`` names a verl key it cannot
    read); a misspelt one is named with the closest of grpolab's and TRL's."""
    known = [*field_types(), "cpu_pack", *sorted(trl.TRL_KEYS)]
    for name in given:
        if name not in known and not verl.is_verl(name):
            raise unknown_key(name, known, command)


def out_of_scope(given: dict[str, Any], command: str, changed: bool = False) -> str | None:
    """What is wrong with grpolab's keys among ``given`` (translated: TRL's and verl's names
    too) that belong to other commands (``dataset`` to the workshop), or None. ``changed``:
    only those off every default of theirs (a run's config.json holds every key)."""
    fields = {f.name: f for f in dataclasses.fields(Config)}
    defaults = {c: command_defaults(c) for c in COMMANDS}
    groups: dict[tuple[str, ...], list[str]] = {}
    for k, v in given.items():
        f = fields.get(k)
        if f is None or command in f.metadata["commands"]:
            continue
        if changed and all(v == defaults[c].get(k, _default(f)) for c in f.metadata["commands"]):
            continue
        groups.setdefault(tuple(f.metadata["commands"]), []).append(k)
    if not groups:
        return None
    parts = [f"{', '.join(keys)} {'is a setting' if len(keys) == 1 else 'are settings'} of "
             f"grpolab {' and '.join(c for c in COMMANDS if c in scope)}"
             for scope, keys in groups.items()]
    return ("; ".join(parts) + f", which grpolab {command} does not read" +
            (" (it trains on its own task world; models and data are grpolab train's)"
             if command == "workshop" else ""))


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]


def _names(given: dict[Any, Any]) -> dict[str, Any]:
    """Keys as attribute names (``max-steps``: ``max_steps``), earlier TRL names as today's,
    verl's nested keys dotted."""
    given = verl.flatten({str(k): v for k, v in given.items()})
    return trl.renamed({k if verl.is_verl(k) else k.replace("-", "_"): v
                        for k, v in given.items()})


def _read(given: dict[str, Any], later: dict[str, Any] | None = None,
          earlier: dict[str, Any] | None = None, command: str = "train",
          under: bool = False) -> dict[str, Any]:
    """Keys in grpolab's names (verl's and TRL's translated), values coerced; ``earlier`` and
    ``later``: the file before them and the overrides after (TRL and verl combine keys);
    ``under``: the peer's defaults, whose verl rules are read whatever ``later`` gives."""
    given = trl.from_trl(verl.from_verl(given, later, earlier, command, under), later, earlier)
    if "steps" in given and "passes" in given and coerce("passes", given["passes"]) > 0:
        if len(given.keys() & field_types().keys()) < len(field_types()) // 2:  # (a run's
            # config.json holds every key, of its version: its steps come from its passes)
            raise ConfigError(f"steps {given['steps']} and passes {given['passes']} both "
                              "given: passes sets the steps; keep one")
        given = {k: v for k, v in given.items() if k != "steps"}
    if "cpu_pack" in given:  # its earlier place, before the speed options
        speed = dataclasses.asdict(coerce("speed", given.get("speed", {})))
        given["speed"] = {**speed, "cpu_pack": given.pop("cpu_pack")}
    return {k: coerce(k, v) for k, v in given.items()}


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def resume_asked(keys: dict[str, Any], out_dir: str, held: bool,
                 overwrite: bool = False) -> bool:
    """Whether a config's own keys (a file's, then the overrides') ask to continue out_dir's
    run, as ``--resume`` does: verl's ``trainer.resume_mode`` (``verl.resume_from``) or TRL's
    ``resume_from_checkpoint`` (true: the last checkpoint, which must exist, as TRL's script
    needs one; a path: out_dir's own run). ``held``: out_dir holds a checkpoint. With
    ``overwrite`` verl's ``auto`` yields, and an explicit ask is refused."""
    keys = _names(keys)
    ask = keys.get("resume_from_checkpoint")
    explicit = (ask is not None and as_word(ask) != "false") or as_word(
        keys.get("trainer.resume_mode")) == "resume_path"  # (_names flattened verl's keys)
    if overwrite:
        if explicit:
            raise ConfigError("resume_from_checkpoint / trainer.resume_mode=resume_path continue "
                              "out_dir's run, overwrite replaces it: keep one")
        return False
    if ask is None or as_word(ask) == "false":
        return verl.resume_from(keys, Path(out_dir), held)
    run = Path(out_dir).expanduser().resolve()
    path = run if as_word(ask) == "true" else Path(str(ask)).expanduser().resolve()
    if not verl.names_the_run(path, run):
        raise ConfigError(f"resume_from_checkpoint: {ask} (TRL): grpolab continues the run in "
                          f"output_dir ({out_dir}) from its last checkpoint, the one that holds "
                          "the optimiser's state: name that folder")
    if not held:
        raise ConfigError(f"resume_from_checkpoint: {ask} (TRL): {out_dir} holds no "
                          "checkpoint to continue from")
    return True