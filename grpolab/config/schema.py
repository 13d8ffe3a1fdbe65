"""One typed config for every run: the fields, their help and the commands they belong to.

A single flat dataclass keeps the mapping YAML key == CLI flag == attribute obvious. Each field
carries its help and the commands that offer it as metadata (``opt``); ``train`` and ``eval``
take a real model's defaults where the workshop's would not do (``train=`` in ``opt``). A value
is read as its field's type in ``grpolab.config.values``, a config in ``grpolab.config.load``,
and checked in ``grpolab.config.validate``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from grpolab.config.speed import Speed
from grpolab.core.advantages import (
    ADVANTAGE_BASELINES,
    ADVANTAGE_SCALES,
    REWARD_AGGREGATIONS,
    STD_KINDS,
)
from grpolab.core.losses import KL_ESTIMATORS, LOSS_AGGREGATIONS, POLICY_LOSSES
from grpolab.core.returns import ESTIMATORS
from grpolab.predict.allocate import ALLOCATION_OBJECTIVES
from grpolab.predict.posterior import PASS_RATE_PRIORS

# The allowed values of the objective's settings are the keys of the maths modules' registries:
# a new variant there is a new choice here, on the command line and in the workshop's presets.
LossAgg = Literal[tuple(LOSS_AGGREGATIONS)]  # type: ignore[valid-type]
PolicyLoss = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]
KLEstimator = Literal[tuple(KL_ESTIMATORS)]  # type: ignore[valid-type]
Baseline = Literal[tuple(ADVANTAGE_BASELINES)]  # type: ignore[valid-type]
Scale = Literal[tuple(ADVANTAGE_SCALES)]  # type: ignore[valid-type]
StdKind = Literal[tuple(STD_KINDS)]  # type: ignore[valid-type]
RewardAggregation = Literal[tuple(REWARD_AGGREGATIONS)]  # type: ignore[valid-type]
PolicyAgg = Literal[("loss", *LOSS_AGGREGATIONS)]  # type: ignore[valid-type]
AllocationObjective = Literal[tuple(ALLOCATION_OBJECTIVES)]  # type: ignore[valid-type]
PassRatePrior = Literal[tuple(PASS_RATE_PRIORS)]  # type: ignore[valid-type]
Estimator = Literal[("grpo", *ESTIMATORS, "ppo")]  # type: ignore[valid-type]

COMMANDS = ("workshop", "train", "eval")
# Which commands offer a field as a flag.
ALL = COMMANDS
RUN = ("workshop", "train")  # the training commands
MODEL = ("train",)  # a real model's training only
MODEL_EVAL = ("train", "eval")
WORLD = ("workshop",)  # the built-in world only
EVAL = ("eval",)


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI prints it on one line and exits with 2."""


def opt(default: Any, commands: tuple[str, ...], help: str, eval_help: str = "",
        **per_command: Any) -> Any:
    """A config field: its default (the workshop's), the commands that offer it, its help (and
    ``eval_help`` where the setting means something else to ``grpolab eval``), and other
    commands' defaults (``train=256``; ``eval`` takes train's)."""
    meta = {"help": help, "commands": commands, "defaults": per_command,
            "helps": {"eval": eval_help} if eval_help else {}}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _copy(value: Any) -> Any:
    return dataclasses.replace(value) if dataclasses.is_dataclass(value) else type(value)(value)


@dataclass
class Config:
    """Everything a run needs. Defaults reproduce the workshop (G=8, 64 answers a step)."""

    # --- run ---
    out_dir: str = opt(
        "runs/workshop", ALL, "where metrics, samples, checkpoints and the model go",
        "where eval.json and completions.jsonl go (--out-dir only: a --config file's out_dir is "
        "its training run's)", train="runs/train", eval="runs/eval")
    seed: int = opt(0, ALL, "seeds sampling, prompt order, LoRA init and the world",
                    "seeds the eval_samples answers and a reasoning_gym: dataset")
    steps: int = opt(40, RUN, "GRPO steps (optimiser updates of one sampled batch each)")
    passes: float = opt(0.0, MODEL, "passes over the training prompts (TRL's num_train_epochs, "
                        "verl's total_epochs): > 0 sets steps to passes x a pass's whole batches")
    pass_batch: int = opt(0, MODEL, "prompts a pass's batch holds (0: a step's; verl's "
                          "gen_batch_size): the whole batches passes count")
    budget: int = opt(64, ALL, "answers generated per step (before dynamic-sampling top-ups)",
                      "answers generated at a time (bounds memory)")
    group_size: int = opt(8, RUN, "G: answers per prompt")
    temperature: float = opt(1.0, ALL, "sampling temperature; log-probs are scored at the same one",
                             "of the eval_samples answers (pass@k); greedy accuracy is at 0")
    # what is sampled besides the temperature (HF generate's order; the loss scores the plain
    # softmax at T, as TRL and verl do): rollout.sampling.Filters
    top_k: int = opt(0, ALL, "sample from the k most likely tokens only (0 = all)")
    top_p: float = opt(1.0, ALL, "sample from the most likely tokens holding this much "
                       "probability (1 = all)")
    min_p: float = opt(0.0, ALL, "drop tokens under min_p x the most likely one's probability")
    repetition_penalty: float = opt(1.0, ALL, "HF's: seen tokens' logits divided (if > 0) or "
                                    "multiplied by it (1 = off; greedy answers too)")
    max_new_tokens: int = opt(
        8, ALL, "longest answer (TRL max_completion_length); the Dr. GRPO length constant",
        "longest answer (TRL max_completion_length)", train=256)
    lr: float = opt(1e-3, RUN, "Adam's learning rate (TRL learning_rate)", train=1e-5)
    weight_decay: float = opt(0.0, RUN, "AdamW's decoupled decay, as TRL's: not on biases and "
                              "norms (verl's actor: 0.01 on all)")
    adam_beta1: float = opt(0.9, RUN, "Adam's first-moment decay")
    adam_beta2: float = opt(0.999, RUN, "Adam's second-moment decay")
    adam_epsilon: float = opt(1e-8, RUN, "Adam's denominator constant")
    lr_schedule: Literal["constant", "linear", "cosine"] = opt(
        "constant", RUN, "decay to 0 at `steps`")
    min_lr_rate: float = opt(0.0, RUN, "cosine: decay to this share of lr, not 0 "
                             "(transformers' cosine_with_min_lr)")
    min_lr: float = opt(0.0, RUN, "cosine: decay to this lr, not 0 (min_lr_rate's other form)")
    warmup_steps: float = opt(0, RUN, "steps of a linear ramp up to lr; below 1 a share of the "
                              "run, rounded up (counted as schedule_per counts)")
    warmup_round: Literal["up", "down"] = opt("up", RUN, "a warmup_steps share's rounding: up "
                                              "(transformers') or down (verl's ratio)")
    warmup_from_zero: bool = opt(False, RUN, "the warm-up's first step at lr 0 (transformers' and "
                                 "verl's); off: at lr / its length, no step wasted")
    schedule_per: Literal["optimiser_step", "step"] = opt(
        "optimiser_step", RUN, "the lr schedule moves each optimiser step (TRL's) or each "
        "sampled batch (verl's: its mini-batches at one lr)")
    grad_clip: float = opt(1.0, RUN, "largest gradient norm kept (TRL max_grad_norm)")
    epochs: int = opt(1, RUN, "mu: optimisation passes over one batch (old-policy ratio when > 1)")
    minibatches: int = opt(1, RUN, "optimiser steps per pass, each on a share of the batch (verl's "
                           "train_batch_size / ppo_mini_batch_size); later ones off-policy")
    minibatch_order: Literal["groups", "shuffled"] = opt(
        "groups", RUN, "groups: whole groups in order (verl's); shuffled: answers dealt at random "
        "(TRL's steps_per_generation)")
    micro_batch: int = opt(0, RUN, "rows per forward/backward in the update (0 = all); same step")
    shard: Literal["none", "fsdp"] = opt(
        "none", RUN, "torchrun: fsdp shards weights, grads, Adam (full FT)")
    eval_every: float = opt(1, RUN, "steps between held-out evaluations (below 1: a share of the "
                            "run's)", train=10)
    eval_size: int = opt(256, ALL, "held-out prompts evaluated (first rows of the split)",
                         "prompts measured: the first rows of eval_dataset, else of dataset")
    eval_samples: int = opt(0, EVAL, "grpolab eval: answers per prompt at `temperature` for pass@k")
    checkpoint_every: float = opt(10, RUN, "steps between checkpoints (0 = none; below 1: a "
                                  "share of the run's steps, rounded up, as transformers)")
    save_model_every: float = opt(
        0, MODEL, "steps between model folders <out_dir>/checkpoint-<step>/ (LoRA merged, loads "
        "with from_pretrained and grpolab eval --model-path); 0 = only final/; below 1: a share")
    save_total_limit: int = opt(0, MODEL, "keep the newest N checkpoint-<step>/ folders (0 = all)")
    save_each_pass: bool = opt(False, MODEL, "checkpoint and save the model at each pass's end, "
                               "not every N steps (TRL's save_strategy epoch)")
    eval_each_pass: bool = opt(False, MODEL, "evaluate at each pass's end, not every eval_every "
                               "steps (TRL's eval_strategy epoch)")
    log_samples: int = opt(1, RUN, "groups a step written to samples.jsonl (answers, rewards); "
                           "0 = none")
    progress: bool = opt(True, ALL, "show a progress bar")
    report_to: list[str] = opt(
        [], RUN,
        "trackers fed every step: tensorboard, wandb, trackio, mlflow, all or none ([] = none)")
    # --- GRPO maths ---
    beta: float = opt(0.04, RUN, "KL weight to the frozen reference (TRL beta, verl kl_loss_coef)")
    kl_estimator: KLEstimator = opt(
        "k3", RUN, "per-token KL: k1 log-ratio, k2 squared/2, k3 Schulman's")
    kl_is_correction: bool = opt(False, RUN, "KL times the policy ratio (TRL "
                                 "use_bias_correction_kl): the same value, another gradient")
    kl_in: Literal["loss", "reward"] = opt("loss", RUN, "reward: beta x the answer's summed KL "
                                           "comes off its reward instead (verl use_kl_in_reward)")
    sync_ref_model: bool = opt(
        False, RUN, "TR-DPO's (TRL's): every ref_model_sync_steps optimiser steps the reference "
        "becomes alpha x policy + (1 - alpha) x itself (full fine-tuning)")
    ref_model_mixup_alpha: float = opt(0.6, RUN, "sync_ref_model: the policy's weight alpha")
    ref_model_sync_steps: int = opt(512, RUN, "sync_ref_model: optimiser steps between syncs")
    policy_loss: PolicyLoss = opt(
        "clip", RUN,
        "clip: PPO per-token ratio; gspo: one ratio per answer; cispo: clipped importance "
        "weight, REINFORCE; sapo: a soft gate, no clip; vespo: REINFORCE weighted by the "
        "answer's ratio; gmpo: geometric mean of clipped token ratios (eps in log space); "
        "kl_cov, clip_cov: the entropy paper's, on the tokens of highest covariance; dppo_tv, "
        "dppo_kl: a trust region on the token's probability; dro: a squared log-ratio penalty; "
        "gpg: plain REINFORCE")
    eps_low: float = opt(0.2, RUN, "the ratio's lower clip is 1 - eps_low (TRL epsilon; gmpo: "
                         "in log space; dppo_*: a divergence bound)")
    eps_high: float = opt(0.2, RUN, "upper clip 1 + eps_high; DAPO clip-higher: 0.28 (TRL "
                          "epsilon_high)")
    dual_clip: float = opt(
        0.0, RUN,
        "cap the ratio of negative-advantage tokens at this (verl clip_ratio_c, TRL delta); 0 = "
        "off")
    cispo_max: float = opt(5.0, RUN, "cispo clips the importance weight at this (TRL epsilon_high)")
    cispo_min: float = opt(0.0, RUN, "... and from below at this (verl: 1 - clip_ratio_low)")
    kl_cov_ratio: float = opt(0.0002, RUN, "kl_cov: share of tokens, by covariance, that get "
                              "the |log ratio| penalty (verl kl_cov_ratio)")
    kl_cov_coef: float = opt(0.1, RUN, "kl_cov: the penalty's weight (verl ppo_kl_coef)")
    clip_cov_ratio: float = opt(0.0002, RUN, "clip_cov: share of tokens, drawn among those "
                                "whose covariance is in (lb, ub), that get no gradient")
    clip_cov_lb: float = opt(1.0, RUN, "clip_cov: the covariance's lower bound (verl clip_cov_lb)")
    clip_cov_ub: float = opt(5.0, RUN, "clip_cov: the covariance's upper bound (verl clip_cov_ub)")
    dppo_cap: float = opt(3.0, RUN, "dppo_tv, dppo_kl: the importance weight's cap (verl "
                          "clip_ratio_c; eps_low/eps_high are their divergence bounds)")
    dro_beta: float = opt(0.1, RUN, "dro: weight of the squared log-ratio penalty (verl "
                          "policy_loss.dro_beta)")
    ratio_level: Literal["token", "sequence"] = opt(
        "token", RUN,
        "cispo, sapo, vespo: the ratio per token or per answer (TRL importance_sampling_level; "
        "PPO's clip per answer is policy_loss gspo)")
    sapo_tau_pos: float = opt(1.0, RUN, "sapo: the gate's temperature for tokens of a positive "
                              "advantage (TRL sapo_temperature_pos, verl tau_pos)")
    sapo_tau_neg: float = opt(1.05, RUN, "sapo: ... of a zero or negative advantage (TRL "
                              "sapo_temperature_neg, verl tau_neg)")
    vespo_k_pos: float = opt(2.0, RUN, "vespo: the weight's power k for an advantage >= 0")
    vespo_lambda_pos: float = opt(3.0, RUN, "vespo: the weight's decay lambda for an advantage >= 0")
    vespo_k_neg: float = opt(3.0, RUN, "vespo: the weight's power k for a negative advantage")
    vespo_lambda_neg: float = opt(2.0, RUN, "vespo: the weight's decay lambda for a negative "
                                  "advantage")
    loss_agg: LossAgg = opt(
        "seq_mean_token_mean", RUN,
        "how token losses become one number (TRL loss_type)")
    policy_agg: PolicyAgg = opt(
        "loss", RUN, "the policy term's mean where not loss_agg's, its KL and entropy as "
        "loss_agg (verl's sapo and geo_mean: seq_mean_token_mean)")
    token_mean_by: Literal["minibatch", "batch"] = opt(
        "minibatch", RUN, "token_mean's divisor: an optimiser step's tokens (verl's) or the "
        "sampled batch's / minibatches (TRL's dapo, cispo, vespo with steps_per_generation)")
    loss_norm_len: int = opt(0, RUN, "seq_mean_token_sum_norm's divisor; 0: max_new_tokens")
    estimator: Estimator = opt(
        "grpo", RUN,
        "grpo: one advantage per answer (baseline, scale below); reinforce_pp, "
        "reinforce_pp_baseline: REINFORCE++'s token-level returns, whitened over the batch; "
        "ppo: GAE on a value model's estimates")
    gamma: float = opt(1.0, RUN, "discount of the token-level estimators' returns")
    lam: float = opt(1.0, RUN, "ppo: GAE's lambda (1: returns minus values; 0: the one step TD error)")
    critic_lr: float = opt(1e-3, RUN, "ppo: the value model's Adam learning rate", train=1e-5)
    critic_warmup: int = opt(0, RUN, "ppo: steps that train only the value model")
    value_clip: float = opt(0.5, RUN, "ppo: a value may move this far from its old estimate "
                            "in the loss (verl cliprange_value)")
    value_agg: LossAgg = opt("token_mean", RUN, "ppo: how the value loss's tokens become one "
                             "number (verl critic.loss_agg_mode, by default its actor's)")
    baseline: Baseline = opt(
        "mean", RUN,
        "mean: r - group mean (GRPO); rloo: r - mean of the others")
    scale: Scale = opt("std", RUN, "divide by the group's std, the batch's std, or none (Dr. "
                       "GRPO); gpg: times answers / answers rewarded (GPG)")
    std: StdKind = opt("population", RUN, "population (/G) or sample (/(G-1)) standard deviation")
    std_eps: float = opt(0.0, RUN, "added to the std before dividing (verl uses 1e-6, TRL 1e-4)")
    min_std: float = opt(0.0, RUN, "tiny-difference guard: divide by max(std, min_std)")
    reward_aggregation: RewardAggregation = opt(
        "sum_then_normalize", RUN,
        "several rewards: normalize_then_sum = GDPO (each reward, then the sum)")
    entropy_coef: float = opt(0.0, RUN, "entropy bonus: the loss minus this x the tokens' entropy")
    entropy_agg: Literal["loss", "token_mean"] = opt(
        "loss", RUN, "the bonus's mean: as the loss's (verl's) or over tokens (TRL's)")
    use_adaptive_entropy: bool = opt(
        False, RUN, "Skywork-OR1's (TRL's): the bonus only while the last step's entropy <= "
        "entropy_target; entropy_coef then +delta, else -delta")
    entropy_target: float = opt(0.2, RUN, "use_adaptive_entropy: the entropy (nats) it keeps")
    entropy_coef_delta: float = opt(0.005, RUN, "use_adaptive_entropy: the coefficient's step")
    entropy_coef_min: float = opt(0.0, RUN, "use_adaptive_entropy: the coefficient's floor")
    entropy_coef_max: float = opt(1.0, RUN, "use_adaptive_entropy: the coefficient's ceiling")
    top_entropy_quantile: float = opt(
        1.0, RUN,
        "the policy loss keeps this top share of tokens by entropy (0.2 in the 80/20 paper; 1 = "
        "every token)")
    off_policy_mask: float = opt(
        0.0, RUN,
        "drop the policy loss of answers with a negative advantage whose mean log(pi_old/pi) "
        "exceeds this (DeepSeek-V3.2; TRL off_policy_mask_threshold); 0 = off")
    success_threshold: float = opt(1.0, ALL, "an answer is right when the first reward reaches "
                                   "this")
    # --- one-switch fixes ---
    dr_grpo: bool = opt(False, RUN, "scale=\"none\" and loss_agg=\"seq_mean_token_sum_norm\"")
    clip_higher: bool = opt(False, RUN, "eps_high = 0.28 (DAPO)")
    token_level_loss: bool = opt(False, RUN, "loss_agg=\"token_mean\" (DAPO)")
    rloo: bool = opt(False, RUN, "baseline=\"rloo\", scale=\"none\"")
    dynamic_sampling: bool = opt(False, RUN, "DAPO: refill the batch with mixed-reward groups")
    dynamic_sampling_on: Literal["total", "first", "acc"] = opt("total", RUN, "the rewards a kept "
        "group's answers differ in: total, first alone, or first's acc (a verl dict's, else first)")
    mask_truncated: bool = opt(
        False, RUN,
        "DAPO overlong filtering: answers cut off by max_new_tokens (no EOS) add nothing to the "
        "loss")
    max_sampling_rounds: int = opt(8, RUN, "extra sampling rounds allowed per step")
    prompt_order: Literal["random", "epochs", "sequential"] = opt(
        "random", RUN, "random: each step draws afresh; epochs: shuffled passes, each prompt "
        "once a pass (TRL's sampler); sequential: passes in the data's order")
    curriculum: bool = opt(False, RUN, "weight prompts by recent pass rate strictly in (0, 1)")
    curriculum_floor: float = opt(
        0.05, RUN,
        "weight of prompts with pass rate 0 or 1 (keeps exploring)")
    curriculum_decay: float = opt(0.5, RUN, "EMA weight of the newest observation")
    # --- dead-group prediction and answer allocation (grpolab.predict) ---
    allocate: bool = opt(
        False, RUN,
        "choose each step's prompts and group sizes from the pass-rate posteriors to spend "
        "`budget` answers on predicted-live groups")
    allocate_objective: AllocationObjective = opt(
        "live_groups", RUN,
        "what allocate maximises: expected live groups, or expected answers in live groups")
    allocate_by_kind: bool = opt(
        False, RUN,
        "give each kind of predict_group_by its share of the budget (its share of the prompts, "
        "as uniform sampling would) and allocate within each kind")
    allocate_min_group: int = opt(4, RUN, "smallest group allocate makes")
    allocate_max_group: int = opt(16, RUN, "largest group allocate makes")
    allocate_explore: float = opt(
        0.1, RUN,
        "share of the budget allocate gives random prompts (revisits prompts predicted dead)")
    predict_decay: float = opt(
        0.97, RUN, "each step, past answers keep this weight in a prompt's posterior")
    predict_prior_strength: float = opt(
        0.0, RUN, "a0 + b0 of the pass-rate prior; 0 = fitted (moments)")
    predict_group_by: str = opt(
        "", RUN,
        "a column of the training rows (e.g. difficulty): prompts with one value share a "
        "fitted pass-rate prior, so a prompt not seen yet is predicted from its own kind")
    predict_prior: PassRatePrior = opt(
        "beta", RUN,
        "the pass-rate prior: one Beta (moments) or a grid of rates with EM-fitted weights "
        "(several bands)")
    alarm_truncated_share: float = opt(
        0.9, RUN,
        "warn NO LEARNING SIGNAL when this share of a step's answers hit max_new_tokens (above "
        "1 = off)")
    # --- built-in world (used when model_path is empty) ---
    world_train_size: int = opt(1024, WORLD, "training prompts the built-in world generates")
    world_heldout_size: int = opt(256, WORLD, "held-out prompts the built-in world generates")
    world_top_share: float = opt(0.24, WORLD, "share of world prompts whose sum reaches 100")
    world_carry_share: float = opt(
        0.68, WORLD,
        "share of the world's sums below 100 with a ones carry")
    sft_steps: int = opt(700, WORLD, "SFT steps that make the built-in start (cached)")
    sft_slip: float = opt(
        0.25, WORLD,
        "the SFT teacher forgets the ones carry with this probability")
    sft_slip_top: float = opt(1.0, WORLD, "... and the carry into the hundreds with this one")
    world_lora_alpha: float = opt(
        2.0, WORLD,
        "LoRA scale numerator of the world's policy (scale alpha/r; lora_alpha is the real "
        "models'): sets how fast RL moves it")
    cache_dir: str = opt("", ALL, "where the world's fine-tuned start and converted .gguf models "
                         "are cached; \"\" = ~/.cache/grpolab")
    # --- real models ---
    defaults: Literal["grpolab", "trl", "verl"] = opt(
        "grpolab", MODEL_EVAL, "what a setting left unset is: grpolab train's default, TRL 1.16 "
        "GRPOConfig's (beta 0, loss_type dapo, lr 1e-6, ...) or verl 0.9.1's (the ones its "
        "config is warned of)")
    model_path: str = opt(
        "", MODEL_EVAL, "HF model folder, a .gguf file or smollm2-135m-instruct")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = opt(
        "float32", MODEL_EVAL, "of the model's weights; auto: the checkpoint's (TRL's auto)")
    device: str = opt(
        "auto", MODEL_EVAL, "where the model runs: auto (CUDA when there is one), cpu, cuda or cuda:N")
    gradient_checkpointing: bool = opt(
        False, MODEL,
        "recompute each layer in backward: memory for time")
    speed: Speed = opt(
        Speed(), MODEL_EVAL,
        "speed paths, each on by default, recorded with the run: lean_forward, cpu_pack, "
        "score_pack, early_exit, length_buckets, head_grad_in_forward, graph_decode (--speed "
        "early_exit=false,cpu_pack=false)")
    logit_chunk: int = opt(
        256, MODEL,
        "answer tokens scored through the LM head at a time (0 = all at once)")
    max_prompt_tokens: int = opt(
        1024, MODEL_EVAL,
        "longer prompts lose their first tokens (0 = model's limit)")
    dataset: str = opt(
        "", MODEL_EVAL, "local jsonl/parquet/csv file or folder, a Hub dataset in the local "
        "cache (ORG/NAME[:CONFIG[:SPLIT]]), or reasoning_gym:<task>", "the same forms; "
        "measured when there is no eval_dataset")
    eval_dataset: str = opt(
        "", MODEL_EVAL, "held-out prompts (same forms); reasoning_gym: uses another seed")
    dataset_size: int = opt(
        1000, MODEL_EVAL, "questions a reasoning_gym: dataset generates for training")
    task_config: dict[str, Any] = opt({}, MODEL_EVAL, "reasoning_gym task options")
    prompt_column: str = opt("prompt", MODEL_EVAL, "dataset column holding the prompts")
    answer_column: str = opt("answer", MODEL_EVAL, "dataset column passed to rewards as answer=")
    prompt_template: str = opt(
        "", MODEL_EVAL,
        "text prompts (a chat prompt's last user message) become this with {prompt} filled "
        "in; \"\" = as is")
    rewards: list[str] = opt(["exact"], MODEL_EVAL, "comma-separated: built-in, rm:DIR, file.py:fn")
    answer_sources: list[str] = opt(
        ["boxed", "answer_tag", "answer_line", "bare", "last_statement"], MODEL_EVAL,
        "where math/reasoning_gym look for the final answer")
    watch_reward: str = opt(
        "", MODEL,
        "strict held-out check for the reward-hacking watch (\"\" = off)")
    watch_margin: float = opt(0.2, MODEL, "flag when training reward rose this much more than "
                              "the check")
    watch_window: int = opt(
        5, MODEL, "steps averaged for the training reward's start and recent level")
    reward_weights: list[float] = opt([], ALL, "one per reward; [] = all 1")
    format_pattern: str = opt(
        "", MODEL_EVAL, "regex of the format reward (\"\" = think/answer tags)")
    reward_on_error: float = opt(0.0, ALL, "score of an answer whose reward raised, hung or gave "
                                 "garbage (None or NaN: not scored, as TRL)")
    lora: bool = opt(True, RUN, "train rank-lora_r adapters; reference = adapters off (no copy)")
    lora_r: int = opt(8, RUN, "LoRA rank")
    lora_alpha: int = opt(16, RUN, "LoRA scale numerator (scale = alpha / r)")
    lora_dropout: float = opt(0.0, MODEL, "LoRA dropout")
    lora_target_modules: list[str] = opt(
        [], MODEL,
        "modules given LoRA adapters, comma-separated (q_proj,v_proj); all-linear = every linear "
        "layer but the head; empty = peft's default for the architecture")
    use_rslora: bool = opt(False, MODEL, "rank-stabilised LoRA: scale alpha / sqrt(r) (peft's)")
    use_dora: bool = opt(False, MODEL, "DoRA: adapters with a learned magnitude (peft's)")
    use_chat_template: bool = opt(True, MODEL_EVAL, "text prompts too in the tokenizer's chat "
                                  "template (false: as written; chat prompts always, as TRL)")
    chat_template: str = opt("", MODEL_EVAL, "a Jinja chat template in place of the tokenizer's "
                             "(\"\" = its own; open-r1's)")
    system_prompt: str = opt("", MODEL_EVAL, "a system message before each prompt that has none "
                             "(\"\" = none; open-r1's)")
    chat_template_kwargs: dict[str, Any] = opt(
        {}, MODEL_EVAL, "what the chat template reads besides the messages, e.g. "
        "'{enable_thinking: false}' for Qwen3 (TRL's)")
    rollout_backend: Literal["hf", "vllm"] = opt("hf", MODEL, "vllm: in-process engine on a GPU")
    # --- reliability ---
    overwrite: bool = opt(
        False, RUN, "start afresh in an out_dir holding a run (deletes its metrics, ckpts)")
    reward_timeout: float = opt(
        10.0, ALL, "seconds per call of a user reward (in a worker); 0 = no limit")
    reward_workers: int = opt(
        0, ALL, "worker processes for user rewards; 0 = one per core (2 to 8)")
    fail_on_reward_errors: bool = opt(
        True, ALL, "stop when a reward fails on every answer of a batch")

    @property
    def prompts_per_step(self) -> int:
        return self.budget // self.group_size


def field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def literal_fields() -> dict[str, tuple]:
    """Allowed values of every Literal-typed field (shared by validation and the CLI)."""
    return {name: typing.get_args(tp) for name, tp in field_types().items()
            if typing.get_origin(tp) is Literal}


def command_defaults(command: str) -> dict[str, Any]:
    """The fields whose default differs for ``command`` from the workshop's, with its value
    (``eval`` takes train's where it has none of its own)."""
    out = {}
    for f in dataclasses.fields(Config):
        given = f.metadata["defaults"]
        if command in given or (command == "eval" and "train" in given):
            out[f.name] = given.get(command, given.get("train"))
    return out
