"""TRL's side of the equivalence tests: its GRPO loss (``GRPOTrainer._compute_loss`` run on a
bare trainer object whose scoring pass returns the test's log-probs), its advantages (the lines
of ``GRPOTrainer._generate_and_score_completions`` that turn rewards into advantages, executed
as they are) and its reward-model scoring. Imports trl: import it after
``pytest.importorskip("trl")``."""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import nanstd


class _Acc:
    """One process: TRL's accelerator calls are identities."""

    num_processes = 1
    sync_gradients = True
    is_main_process = True
    device = torch.device("cpu")

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction="sum"):
        return t

    def pad_across_processes(self, t, dim=0, pad_index=0):
        return t


# the loss types' own settings, which TRL reads from its args: GRPOConfig's defaults
_LOSS_ARGS = {f.name: f.default for f in dataclasses.fields(GRPOConfig)
              if f.name.startswith(("sapo_", "vespo_"))}


def bare_trainer(**over) -> GRPOTrainer:
    t = GRPOTrainer.__new__(GRPOTrainer)
    args = SimpleNamespace(use_bias_correction_kl=over.pop("use_bias_correction_kl", False),
                           delta=over.pop("delta", None), entropy_target=0.0,
                           steps_per_generation=1, device=torch.device("cpu"), report_to=[],
                           **{k: over.pop(k, v) for k, v in _LOSS_ARGS.items()})
    attrs = {"args": args, "beta": 0.0, "loss_type": "grpo",
             "importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2,
             "top_entropy_quantile": 1.0, "entropy_coef": 0.0, "use_adaptive_entropy": False,
             "off_policy_mask_threshold": None, "use_vllm": False, "aux_loss_enabled": False,
             "current_gradient_accumulation_steps": 1,
             "model": SimpleNamespace(training=True), "accelerator": _Acc(),
             "is_deepspeed_enabled": False, "state": SimpleNamespace(global_step=0),
             "_metrics": {"train": defaultdict(list), "eval": defaultdict(list)}}
    attrs.update(over)
    attrs["_entropy_bonus_enabled"] = attrs["entropy_coef"] != 0.0
    t.__dict__.update(attrs)
    return t


def trl_loss(logp, old, ref, adv, mask, entropies=None, **over) -> torch.Tensor:
    """TRL 1.16's GRPO loss on these per-token log-probs (a single process, no accumulation)."""
    ent = entropies if entropies is not None else torch.zeros_like(logp)
    return trl_step_loss(bare_trainer(**over), logp, old, ref, adv, mask, ent)


def adaptive_trainer(args: dict, **over) -> GRPOTrainer:
    """A bare trainer (``over``: as ``bare_trainer``'s) with TRL's adaptive entropy control on
    (``args``: entropy_target, entropy_coef_delta/min/max); the controller's state lives on
    it, step after step."""
    tr = bare_trainer(use_adaptive_entropy=True, **over)
    tr.args.__dict__.update(args)
    tr._entropy_bonus_enabled, tr._last_world_entropy = True, float("inf")
    tr._entropy_window_stats = None
    return tr


def trl_step_loss(tr: GRPOTrainer, logp, old, ref, adv, mask, entropies,
                  items=None) -> torch.Tensor:
    """One optimiser step's loss of the bare trainer ``tr`` (one micro-batch; its state, such
    as the adaptive entropy controller's, carried from step to step); ``items``: the
    generation batch's tokens (TRL's num_items_in_batch; default this step's)."""
    b, t = logp.shape
    tr.max_completion_length = t
    tr._get_per_token_logps_and_entropies = lambda *a, **k: (logp, entropies, None)
    inputs = {"prompt_ids": torch.zeros(b, 1, dtype=torch.long),
              "prompt_mask": torch.ones(b, 1, dtype=torch.long),
              "completion_ids": torch.zeros(b, t, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": mask.sum() if items is None else items}
    return GRPOTrainer._compute_loss(tr, None, inputs)


def trl_advantages(per_fn: torch.Tensor, weights: list[float], g: int,
                   scale_rewards: str = "group",
                   aggregation: str = "sum_then_normalize") -> torch.Tensor:
    """The advantage lines of GRPOTrainer._generate_and_score_completions, run as they are."""
    lines = inspect.getsource(GRPOTrainer._generate_and_score_completions).splitlines()
    start = next(i for i, s in enumerate(lines)
                 if 'if self.multi_objective_aggregation == "sum_then_normalize":' in s)
    end = next(i for i, s in enumerate(lines)
               if "advantages = torch.nan_to_num(advantages, nan=0.0)" in s)
    ns = {"self": SimpleNamespace(multi_objective_aggregation=aggregation,
                                  reward_weights=torch.tensor(weights),
                                  scale_rewards=scale_rewards),
          "rewards_per_func": per_fn.clone(), "unscorable_mask": torch.isnan(per_fn).all(1),
          "num_generations": g, "device": "cpu", "torch": torch, "nanstd": nanstd}
    ns["self"].reward_funcs = [None] * per_fn.shape[1]
    exec(textwrap.dedent("\n".join(lines[start : end + 1])), ns)  # noqa: S102 - TRL's code
    return ns["advantages"]


def trl_model_rewards(fn, prompts, completions) -> list[float]:
    """TRL's scores for a grpolab reward model (its model and tokenizer, called as TRL does)."""
    tr = bare_trainer(reward_funcs=[fn.model], reward_processing_classes=[fn.tokenizer],
                      reward_func_names=["rm"], environments=None, chat_template_kwargs={})
    inputs = [{"prompt": p} for p in prompts]
    tr._log_completion_extra = tr._log_metric = lambda *a, **k: None
    return GRPOTrainer._calculate_rewards(tr, inputs, prompts, completions, None)[:, 0].tolist()
