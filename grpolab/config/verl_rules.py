"""What verl reads together, read as verl 0.9.1 reads it: the batch and its mini-batches, the
KL term, the advantage estimator, the policy loss, the model, sampling, the data, the trainer's
length and intervals, the rewards (DAPO's overlong buffer too), the schedule, the critic and
DAPO's group filtering. Each rule takes every key the run is given (``d``: dotted verl keys and
grpolab's own) and returns grpolab's settings; ``RULES`` pairs each with the keys that call
it (``grpolab.config.verl.from_verl`` runs it when one of them is given)."""

from __future__ import annotations

import logging
from typing import Any

from grpolab.config.schema import ConfigError
from grpolab.config.trl_values import as_number, as_word
from grpolab.config.verl_fields import OVERLONG, VAL_KWARGS, VERL_DEFAULTS, A, M, R

log = logging.getLogger("grpolab")
_KL = {"low_var_kl": "k3", "k3": "k3", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}
_ESTIMATORS: dict[str, dict[str, Any]] = {
    "grpo": {"estimator": "grpo", "baseline": "mean"},
    "rloo": {"estimator": "grpo", "baseline": "rloo", "scale": "none"},
    "gpg": {"estimator": "grpo", "scale": "gpg"},
    "reinforce_plus_plus": {"estimator": "reinforce_pp"},
    "reinforce_plus_plus_baseline": {"estimator": "reinforce_pp_baseline"},
    "gae": {"estimator": "ppo"}}
_ESTIMATORS.update(grpo_vectorized=_ESTIMATORS["grpo"], rloo_vectorized=_ESTIMATORS["rloo"])
_LOSS_MODES = {"vanilla": "clip", "geo_mean": "gmpo", "gspo": "gspo", "cispo": "cispo",
               "sapo": "sapo", "gpg": "gpg", "clip_cov": "clip_cov", "kl_cov": "kl_cov",
               "dppo_tv": "dppo_tv", "dppo_kl": "dppo_kl", "dro": "dro"}
_TRACKERS = ("wandb", "tensorboard", "mlflow", "trackio")


def flag(d: dict[str, Any], key: str, default: bool = False) -> bool:
    """A verl switch read as OmegaConf reads it (true/false, 1/0, yes/no); anything else is a
    one-line error, not false."""
    value = d.get(key, default)
    word = as_word(value)
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key}={value!r} (verl): not true or false")


def _whole(d: dict[str, Any], key: str) -> int:
    n = as_number(d.get(key, VERL_DEFAULTS.get(key)))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"{key}={d.get(key)!r} (verl) must be a whole number >= 1")
    return n


def _count(d: dict[str, Any], key: str) -> int:
    """A verl frequency or count (-1 or 0: off), as an int; anything else a one-line error."""
    n = as_number(d[key])
    if not isinstance(n, int) or isinstance(n, bool):
        raise ConfigError(f"{key}={d[key]!r} (verl) must be a whole number (-1: off)")
    return n


def _total_steps(d: dict[str, Any]) -> Any:  # (verl's total_training_steps, or grpolab's steps)
    return as_number(d.get("trainer.total_training_steps", d.get("steps")))


def _batch(d: dict[str, Any]) -> dict[str, Any]:
    """data.train_batch_size prompts x rollout.n answers a step; train_batch_size /
    ppo_mini_batch_size optimiser steps on it (verl refuses shares that are not equal)."""
    if not {"data.train_batch_size", A + "ppo_mini_batch_size"} & d.keys():
        return {}  # (rollout.n alone: group_size)
    if "data.train_batch_size" not in d:
        raise ConfigError(f"{A}ppo_mini_batch_size (verl) counts prompts of "
                          "data.train_batch_size: give that too")
    prompts, mini = _whole(d, "data.train_batch_size"), _whole(d, A + "ppo_mini_batch_size")
    group = as_number(d.get("__group", 8))
    if prompts % mini:
        default = "" if A + "ppo_mini_batch_size" in d else " (verl's default)"
        raise ConfigError(f"data.train_batch_size {prompts} is not a multiple of "
                          f"{A}ppo_mini_batch_size {mini}{default}: verl refuses it too")
    return {"budget": prompts * int(group), "minibatches": prompts // mini}


def _kl(d: dict[str, Any]) -> dict[str, Any]:
    in_loss, in_reward = flag(d, A + "use_kl_loss"), flag(d, "algorithm.use_kl_in_reward")
    if in_loss and in_reward:
        raise ConfigError(f"{A}use_kl_loss and algorithm.use_kl_in_reward (verl) are both "
                          "true: grpolab puts the KL in one place (kl_in: loss or reward)")
    if as_word(d.get("algorithm.kl_ctrl.type", "fixed")) != "fixed":
        raise ConfigError("algorithm.kl_ctrl.type (verl): grpolab's KL weight is fixed")
    key = A + "kl_loss_type" if in_loss else "algorithm.kl_penalty"
    kind = as_word(d.get(key, "low_var_kl" if in_loss else "kl"))
    if (in_loss or in_reward) and kind not in _KL:
        raise ConfigError(f"{key}={kind} (verl) has no grpolab estimator; grpolab reads "
                          f"{', '.join(_KL)}")
    if in_loss:
        return {"kl_in": "loss", "beta": d.get(A + "kl_loss_coef", 0.001), "kl_estimator": _KL[kind]}
    if in_reward:
        return {"kl_in": "reward", "beta": d.get("algorithm.kl_ctrl.kl_coef", 0.001),
                "kl_estimator": _KL[kind]}
    return {"beta": 0.0}  # verl adds no KL unless asked


def _advantage(d: dict[str, Any]) -> dict[str, Any]:
    name = as_word(d.get("algorithm.adv_estimator", VERL_DEFAULTS["algorithm.adv_estimator"]))
    if name not in _ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator={name} (verl) has no grpolab equivalent; "
                          f"grpolab reads {', '.join(_ESTIMATORS)}")
    out = dict(_ESTIMATORS[name])
    if not flag(d, "algorithm.norm_adv_by_std_in_grpo", True) and name == "grpo":
        out["scale"] = "none"  # Dr. GRPO's advantage (verl reads it with grpo only)
    return out


def _loss(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if A + "loss_agg_mode" in d:
        out["loss_agg"] = as_word(d[A + "loss_agg_mode"]).replace("-", "_")
        # (a run with a value model: verl's gae, or grpolab's ppo; none named is grpolab's
        # grpo, as the run trains: defaults: verl brings verl's gae here)
        critic = (as_word(d["algorithm.adv_estimator"]) == "gae"
                  if "algorithm.adv_estimator" in d else as_word(d.get("estimator")) == "ppo")
        if "critic.loss_agg_mode" not in d and critic:  # (verl's critic, gae's only,
            out["value_agg"] = out["loss_agg"]  # takes its actor's by default)
    mode = as_word(d.get(A + "policy_loss.loss_mode", "vanilla"))
    if mode not in _LOSS_MODES:
        raise ConfigError(f"{A}policy_loss.loss_mode={mode} (verl) has no grpolab equivalent; "
                          f"grpolab reads {', '.join(_LOSS_MODES)}")
    given = A + "policy_loss.loss_mode" in d
    # the run's policy loss: grpolab's policy_loss where given beside verl's (a later layer's)
    loss = d.get("policy_loss", _LOSS_MODES[mode] if given else None)
    if given:  # (else grpolab's policy_loss, if given, stands)
        out["policy_loss"] = _LOSS_MODES[mode]
        if loss in ("sapo", "gmpo") and loss == _LOSS_MODES[mode]:  # verl's: their policy
            # term so, whatever loss_agg_mode (not another loss's given over verl's)
            out["policy_agg"] = "seq_mean_token_mean"
    if A + "clip_ratio_c" in d and loss != "gspo":  # the dual clip (none in verl's gspo); for
        # DPPO the importance weight's cap
        out["dppo_cap" if str(loss).startswith("dppo") else "dual_clip"] = d[A + "clip_ratio_c"]
    if mode == "cispo":  # verl's bounds on the weight: 1 - low and 1 + high
        out["cispo_min"] = 1 - float(d.get(A + "clip_ratio_low", 0.2))
        out["cispo_max"] = 1 + float(d.get(A + "clip_ratio_high", 0.2))
    if A + "clip_ratio" in d and not {A + "clip_ratio_low", A + "clip_ratio_high"} & d.keys():
        log.warning("%sclip_ratio (verl) is left aside: verl 0.9.1 clips at clip_ratio_low and "
                    "clip_ratio_high (0.2 each by default), not at it", A)
    return out


def _model(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if M + "lora_rank" in d:
        r = as_number(d[M + "lora_rank"])
        out.update({"lora": False} if r == 0 else {"lora": True, "lora_r": r})
    if out.get("lora") or M + "target_modules" in d:  # (verl's default: every linear layer)
        t = d.get(M + "target_modules", "all-linear")
        if M + "target_modules" in d or "lora_target_modules" not in d:
            out["lora_target_modules"] = [t] if isinstance(t, str) else list(t)
    return out


def _sampling(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if R + "top_k" in d:
        k = as_number(d[R + "top_k"])
        out["top_k"] = 0 if k == -1 else k
    if not flag(d, R + "do_sample", True):
        raise ConfigError(f"{R}do_sample=false (verl): GRPO samples its answers (greedy groups "
                          "would all be dead)")
    if R + "name" in d:
        name = as_word(d[R + "name"])
        if name not in ("vllm", "hf"):
            raise ConfigError(f"{R}name={name} (verl): grpolab samples with hf or vllm")
        out["rollout_backend"] = name
    return out


def _validation(d: dict[str, Any]) -> dict[str, Any]:
    """verl's validation sampling, for ``grpolab eval``: with do_sample and a temperature above
    0, val_kwargs.n answers a prompt at its temperature, top_p and top_k (eval.json's pass@1
    is verl's acc mean@n); else greedy, as verl's default. (Training's held-out accuracy is
    greedy whatever they say.)"""
    if d.get("__command") != "eval" or not flag(d, VAL_KWARGS[1]):
        return {}
    n, t = as_number(d.get(VAL_KWARGS[0], 1)), as_number(d.get(VAL_KWARGS[2], 0))
    if not isinstance(t, (int, float)) or t <= 0:
        return {}  # (verl samples at temperature 0: greedy)
    k = as_number(d.get(VAL_KWARGS[4], -1))
    return {"eval_samples": n, "temperature": t, "top_p": d.get(VAL_KWARGS[3], 1.0),
            "top_k": 0 if k == -1 else k}


def _data(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, ours in (("data.train_files", "dataset"), ("data.val_files", "eval_dataset")):
        if key in d:
            files = d[key] if isinstance(d[key], list) else [d[key]]
            if len(files) != 1:
                raise ConfigError(f"{key} (verl): grpolab reads one file or folder (a folder "
                                  f"holds several); got {len(files)}")
            out[ours] = str(files[0])
    if {"data.train_files", "data.val_files"} & d.keys() and "answer_column" not in d:
        out["answer_column"] = "reward_model.ground_truth"  # verl's data layout
    if "data.val_files" in d and "eval_size" not in d:
        out["eval_size"] = 1_000_000  # verl validates every row (grpolab: the first eval_size)
    named = ("rewards" in d or d.get("custom_reward_function.path")
             or d.get("reward.custom_reward_function.path") or flag(d, "reward_model.enable")
             or flag(d, "reward.reward_model.enable"))
    if "data.train_files" in d and not named:
        raise ConfigError("data.train_files (verl) without a reward: verl's default "
                          "(default_compute_score by data_source) is not at hand here; name one "
                          "(custom_reward_function.path=..., or rewards: [math])")
    if "data.shuffle" in d:
        out["prompt_order"] = "epochs" if flag(d, "data.shuffle") else "sequential"
    if A + "shuffle" in d:  # verl's actor deals its answers into mini-batches at random
        out["minibatch_order"] = "shuffled" if flag(d, A + "shuffle") else "groups"
    if (key := d.get("data.reward_fn_key", "data_source")) != "data_source":
        raise ConfigError(f"data.reward_fn_key={key} (verl): grpolab (and verl 0.9.1's "
                          "reward loop) give the reward the rows' data_source column as "
                          f"data_source: rename {key} to it")
    cut = as_word(d.get("data.truncation", "error"))
    if cut not in ("error", "left"):
        raise ConfigError(f"data.truncation={cut} (verl): grpolab keeps a long prompt's last "
                          "max_prompt_length tokens (verl's left)")
    if cut == "error" and "data.truncation" in d and not flag(d, "data.filter_overlong_prompts"):
        log.warning("data.truncation=error (verl stops at a prompt over max_prompt_length): "
                    "grpolab keeps its last max_prompt_length tokens (verl's left) and says so")
    if flag(d, "data.filter_overlong_prompts"):
        log.warning("data.filter_overlong_prompts (verl drops prompts over max_prompt_length): "
                    "grpolab keeps their last max_prompt_length tokens instead")
    return out


def _trainer(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    epochs = _whole(d, "trainer.total_epochs") if "trainer.total_epochs" in d else None
    if epochs and not {"trainer.total_training_steps", "steps", "max_steps", "passes"} & d.keys():
        # verl: total_epochs x the whole batches of a pass, counted when the data is read
        out["passes"] = epochs
    if epochs and not {"data.shuffle", "prompt_order"} & d.keys():
        out["prompt_order"] = "epochs"  # (verl's shuffled passes; kept when --steps extends)
    if "trainer.save_freq" in d:
        out["checkpoint_every"] = max(_count(d, "trainer.save_freq"), 0)
    test = _count(d, "trainer.test_freq") if "trainer.test_freq" in d else -1
    if test > 0:
        out["eval_every"] = test
    elif "trainer.test_freq" in d:  # verl: before training only (grpolab also after the last,
        out["eval_every"] = 10**9  # whatever length a later --steps or the data gives the run)
    mode = as_word(d.get("trainer.resume_mode", "auto"))  # (read by the CLI: resume_from)
    if mode not in ("auto", "disable", "resume_path") or (
            mode == "resume_path" and not d.get("trainer.resume_from_path")):
        raise ConfigError(f"trainer.resume_mode={mode} (verl): auto, disable, or resume_path "
                          "with trainer.resume_from_path")
    if "trainer.logger" in d:
        loggers = d["trainer.logger"] if isinstance(d["trainer.logger"], list) else [
            d["trainer.logger"]]
        bad = [x for x in loggers if x not in ("console", *_TRACKERS)]
        if bad:
            raise ConfigError(f"trainer.logger (verl): {', '.join(map(str, bad))} is not one of "
                              f"grpolab's trackers ({', '.join(_TRACKERS)})")
        out["report_to"] = [x for x in loggers if x != "console"]
    return out


def _rewards(d: dict[str, Any]) -> dict[str, Any]:
    specs = []
    for on, path in (("reward_model.enable", "reward_model.model.path"),
                     ("reward.reward_model.enable", "reward.reward_model.model_path")):
        if flag(d, on):
            if not d.get(path):
                raise ConfigError(f"{on} (verl) needs {path}")
            specs.append(f"rm:{d[path]}")
    manager = as_word(d.get("reward_model.reward_manager", d.get("reward.reward_manager.name",
                                                                  "naive")))
    if manager not in ("naive", "dapo", "rate_limited", "prime", "batch"):
        raise ConfigError(f"reward manager {manager} (verl): grpolab calls a verl reward as "
                          "the naive, dapo and rate_limited managers do (per answer), or as "
                          "the earlier batch (and prime) ones did")
    for root in ("custom_reward_function.", "reward.custom_reward_function."):
        if d.get(root + "path"):
            kind = "verl-batch" if manager == "batch" else "verl"
            specs.append(f"{kind}:{d[root + 'path']}:{d.get(root + 'name') or 'compute_score'}")
    out: dict[str, Any] = {"rewards": specs} if specs else {}
    kw = "reward_model.reward_kwargs."
    if any(k.startswith(kw) for k in d):  # (verl 0.9.1 moves them to reward.reward_kwargs,
        d = {k: v for k, v in d.items() if not k.startswith("reward.reward_kwargs.")}  # whole)
        d.update({"reward.reward_kwargs." + k[len(kw):]: v for k, v in d.items()
                  if k.startswith(kw)})
    roots = [(root, limit) for root, limit in (
        ("reward_model.overlong_buffer.", "data.max_response_length"),
        ("reward.reward_kwargs.overlong_buffer_cfg.", "reward.reward_kwargs.max_resp_len"))
        if flag(d, root + "enable")]  # (DAPO's reward manager adds factor x the punishment)
    named = {"reward_model.reward_manager", "reward.reward_manager.name"} & d.keys()
    if roots and manager != "dapo" and named:
        raise ConfigError(f"{roots[0][0]}enable (verl): verl's {manager} reward manager does "
                          "not apply the overlong buffer (its dapo manager does): set "
                          "reward_model.reward_manager=dapo, or leave the buffer off")
    if roots and not named:
        log.warning("%senable (verl): applied, as verl's dapo reward manager would; with no "
                    "reward_manager named verl's naive one leaves it off", roots[0][0])
    if len(roots) > 1:
        raise ConfigError("reward_model.overlong_buffer.enable and reward(_model).reward_kwargs."
                          "overlong_buffer_cfg.enable (verl) both add DAPO's overlong "
                          "punishment: keep one of them")
    for root, limit in roots:
        if not specs:
            raise ConfigError(f"{root}enable (verl) adds to the score of the reward verl names: "
                              "give custom_reward_function.path, or grpolab's rewards with "
                              "overlong:LEN and reward_weights")
        top = d.get(limit, d.get("data.max_response_length", d.get("max_new_tokens")))
        longest = as_number(d.get("data.max_response_length", d.get("max_new_tokens")))
        if top is not None and isinstance(longest, int) and as_number(top) < longest:
            raise ConfigError(f"{limit}={top} (verl) is below the answers' length limit "
                              f"{longest}: past it verl's overlong penalty keeps falling below "
                              "-penalty_factor, grpolab's overlong stops at -1; give them equal")
        buffer = _whole(d, root + "len")
        if top is not None and buffer > as_number(top):  # (verl asserts it)
            raise ConfigError(f"{root}len={buffer} (verl) must not exceed the length limit {top}")
        out["rewards"] = [*specs, ":".join(map(str, ["overlong", *([top] * (top is not None)),
                                                     buffer]))]
        if (factor := float(as_number(d.get(root + "penalty_factor", 1.0)))) != 1.0:
            out["reward_weights"] = [1.0] * len(specs) + [factor]
    return out


def _schedule(d: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    kind = as_word(d.get(A + "optim.warmup_style") or d.get(A + "optim.lr_scheduler_type")
                   or "constant")
    if kind not in ("constant", "cosine"):
        raise ConfigError(f"{A}optim.lr_scheduler_type={kind} (verl): grpolab reads constant "
                          "or cosine")
    if {A + "optim.warmup_style", A + "optim.lr_scheduler_type"} & d.keys():
        out["lr_schedule"] = kind
    if as_number(d.get(A + "optim.num_cycles", 0.5)) != 0.5:
        raise ConfigError(f"{A}optim.num_cycles (verl): grpolab's cosine is half a cycle (0.5)")
    if as_word(d.get(A + "optim.optimizer", "AdamW")) not in ("adamw", "adam"):
        raise ConfigError(f"{A}optim.optimizer (verl): grpolab's optimiser is AdamW")
    if A + "optim.betas" in d:
        out["adam_beta1"], out["adam_beta2"] = (float(b) for b in d[A + "optim.betas"])
    steps = as_number(d.get(A + "optim.lr_warmup_steps", -1))
    ratio = float(as_number(d.get(A + "optim.lr_warmup_steps_ratio", 0.0)))
    if isinstance(steps, int) and steps > 0:
        out["warmup_steps"] = steps
    elif ratio > 0:
        total = _total_steps(d)
        if not ratio < 1:
            raise ConfigError(f"{A}optim.lr_warmup_steps_ratio (verl) must be below 1 (got "
                              f"{ratio:g}): a share of the run's steps")
        if isinstance(total, int):
            out["warmup_steps"] = int(ratio * total)
        else:  # (total_epochs: the steps are counted from the data, the share rounded down)
            out["warmup_steps"], out["warmup_round"] = ratio, "down"
    from_zero = flag(d, A + "optim.zero_indexed_step", True)
    if not from_zero and kind == "cosine":
        raise ConfigError(f"{A}optim.zero_indexed_step=false (verl: a cosine counted from 1, "
                          "torchtitan's): grpolab's schedule counts steps from 0")
    if out.get("warmup_steps") and "warmup_from_zero" not in d:  # (verl: the first step at
        # lr 0; its constant schedule counts from 0 whatever zero_indexed_step says)
        out["warmup_from_zero"] = from_zero or kind == "constant"
    if (out.get("warmup_steps") or kind == "cosine") and "schedule_per" not in d:
        out["schedule_per"] = "step"  # verl moves its schedule once a training step
    return out


def _critic(d: dict[str, Any]) -> dict[str, Any]:
    """grpolab's value model is a copy of the policy, stepped on the actor's mini-batches."""
    if d.get("critic.model.path") not in (None, d.get(M + "path"), d.get("model_path")):
        raise ConfigError("critic.model.path (verl): grpolab's value model is a copy of the "
                          "policy (actor_rollout_ref.model.path)")
    for key, actor in (("critic.ppo_mini_batch_size", A + "ppo_mini_batch_size"),
                       ("critic.ppo_epochs", A + "ppo_epochs")):
        if key in d and str(d[key]) != str(d.get(actor, VERL_DEFAULTS.get(actor, 1))):
            raise ConfigError(f"{key} (verl): grpolab's value model takes the actor's ({actor})")
    if "critic.loss_agg_mode" in d:  # (by default the actor's loss_agg_mode: _loss)
        return {"value_agg": as_word(d["critic.loss_agg_mode"]).replace("-", "_")}
    return {}


def _filter_groups(d: dict[str, Any]) -> dict[str, Any]:
    on = flag(d, "algorithm.filter_groups.enable")
    if "data.gen_batch_size" in d and not on:
        raise ConfigError("data.gen_batch_size (verl) without algorithm.filter_groups: set "
                          "data.train_batch_size to the prompts a step trains on")
    if "data.gen_batch_size" in d:  # (verl: prompts sampled a round, DAPO's refill)
        log.warning("data.gen_batch_size (verl): grpolab samples rounds of train_batch_size "
                    "prompts until the batch is full (as many prompts at most as verl's "
                    "max_num_gen_batches rounds of gen_batch_size)")
    if not on:
        return {}
    # verl's loader serves gen_batch_size prompts: total_epochs count its whole batches
    size = {"pass_batch": _whole(d, "data.gen_batch_size")} if "data.gen_batch_size" in d else {}
    metric = as_word(d.get("algorithm.filter_groups.metric", "reward"))
    if metric not in ("reward", "acc", "score", "seq_reward", "seq_final_reward"):
        raise ConfigError(f"algorithm.filter_groups.metric={metric} (verl): grpolab keeps the "
                          "groups whose rewards differ")
    # acc / score: the named reward's own, before DAPO's overlong penalty (its first reward);
    # acc: its dict's acc where it returns one
    judged = {"dynamic_sampling_on": {"acc": "acc", "score": "first"}.get(metric, "total")}
    n = _count(d, "algorithm.filter_groups.max_num_gen_batches") if (
        "algorithm.filter_groups.max_num_gen_batches" in d) else 0
    if n >= 1:  # DAPO's recipe: batches sampled, the first included
        gen, train = as_number(d.get("data.gen_batch_size")), as_number(
            d.get("data.train_batch_size"))
        if isinstance(gen, int) and isinstance(train, int) and gen > 0 and train > 0:
            n = -(-n * gen // train)  # (verl's rounds are of gen_batch_size prompts, grpolab's
        return {"max_sampling_rounds": n - 1, **judged, **size}  # (of train_batch_size:
        # as many at most)
    log.warning("algorithm.filter_groups (verl 0.9.1 samples until the batch is full): "
                "grpolab caps the extra rounds at max_sampling_rounds")
    return {**judged, **size}


RULES = (
    (("data.train_batch_size", A + "ppo_mini_batch_size", R + "n"), _batch),
    ((A + "use_kl_loss", A + "kl_loss_coef", A + "kl_loss_type", "algorithm.use_kl_in_reward",
      "algorithm.kl_ctrl.kl_coef", "algorithm.kl_penalty", "algorithm.kl_ctrl.type"), _kl),
    (("algorithm.adv_estimator", "algorithm.norm_adv_by_std_in_grpo"), _advantage),
    ((A + "policy_loss.loss_mode", A + "loss_agg_mode", A + "clip_ratio", A + "clip_ratio_c"),
     _loss),
    ((M + "lora_rank", M + "target_modules"), _model),
    ((R + "top_k", R + "do_sample", R + "name"), _sampling),
    (VAL_KWARGS, _validation),
    (("data.train_files", "data.val_files", "data.shuffle", A + "shuffle", "data.truncation",
      "data.filter_overlong_prompts", "custom_reward_function.path", "data.reward_fn_key"),
     _data),
    (("trainer.total_epochs", "trainer.save_freq", "trainer.test_freq", "trainer.logger",
      "trainer.resume_mode", "trainer.resume_from_path"), _trainer),
    (("reward_model.enable", "reward_model.model.path", "reward.reward_model.enable",
      "reward.reward_model.model_path", "custom_reward_function.path",
      "custom_reward_function.name", "reward.custom_reward_function.path",
      "reward.custom_reward_function.name", "reward_model.reward_manager",
      "reward.reward_manager.name", *OVERLONG), _rewards),
    ((A + "optim.lr_scheduler_type", A + "optim.warmup_style", A + "optim.lr_warmup_steps",
      A + "optim.lr_warmup_steps_ratio", A + "optim.betas", A + "optim.optimizer",
      A + "optim.num_cycles", A + "optim.zero_indexed_step"), _schedule),
    (("critic.model.path", "critic.ppo_mini_batch_size", "critic.ppo_epochs",
      "critic.loss_agg_mode"), _critic),
    (("algorithm.filter_groups.enable", "algorithm.filter_groups.metric",
      "algorithm.filter_groups.max_num_gen_batches", "data.gen_batch_size"), _filter_groups),
)
