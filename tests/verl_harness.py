"""verl's side of the equivalence tests: verl 0.9's own functions, run from its source files as
they are (importing the package would need ray, so each function is executed in a namespace of
its own, with verl's ``masked_*`` helpers and ``agg_loss`` beside it)."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch


def verl_functions(*names: str) -> dict[str, Any]:
    """verl 0.9's functions ``names`` from trainer/ppo/core_algos.py and utils/
    torch_functional.py (its masked helpers, its lr schedules), executed as written
    (decorators left off)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("verl is not installed: pip install --no-deps verl==0.9.1 (.ci/run does)")
    root = Path(spec.submodule_search_locations[0])
    ns: dict[str, Any] = {"torch": torch, "defaultdict": defaultdict, "Optional": Optional,
                          "Any": Any, "AlgoConfig": type("AlgoConfig", (), {}),
                          "ActorConfig": object,  # the tests' configs are namespaces
                          "math": math, "Optimizer": torch.optim.Optimizer,
                          "LambdaLR": torch.optim.lr_scheduler.LambdaLR}  # (the schedules')
    ns.update(np=np, os=os, get_device_name=lambda: "cpu")  # (groupwise's, on the CPU)
    helpers = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")
    grouped = ("_resolve_device", "_to_1d_numpy_object_array", "as_torch_index", "group_mean_std")
    names = (*names, "agg_loss") if "agg_loss" not in names else names
    for file, wanted in (("utils/torch_functional.py", (*helpers, *names)),
                         ("utils/groupwise.py", grouped),  # (the vectorized estimators')
                         ("trainer/ppo/core_algos.py", names)):
        tree = ast.parse((root / file).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                node.decorator_list = []
                exec(compile(ast.Module([node], []), file, "exec"), ns)  # noqa: S102 - verl's code
    ns["verl_F"] = SimpleNamespace(**{h: ns[h] for h in helpers if h in ns})
    return ns


class VerlConfig(SimpleNamespace):
    """A verl config section (ActorConfig, its policy_loss) as a namespace with ``get``."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class _Padded(dict):
    """verl's TensorDict of padded tensors: ``select(...).to_padded_tensor()`` is itself."""

    def select(self, *keys: str) -> _Padded:
        return _Padded({k: self[k] for k in keys})

    def to_padded_tensor(self) -> _Padded:
        return self


def _source(file: str, names: tuple[str, ...], ns: dict[str, Any]) -> None:
    """Execute verl's top-level functions ``names`` of ``file`` (decorators left off) in ns."""
    root = Path(importlib.util.find_spec("verl").submodule_search_locations[0])
    for node in ast.parse((root / file).read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            exec(compile(ast.Module([node], []), file, "exec"), ns)  # noqa: S102 - verl's code


POLICY_MODES = ("vanilla", "gspo", "sapo", "geo_mean", "cispo", "gpg", "dro", "dppo_tv",
                "dppo_kl", "kl_cov", "clip_cov")


def verl_ppo_loss() -> Any:
    """verl 0.9.1's actor loss, ``workers/utils/losses.py::ppo_loss`` as it is: the policy loss
    its config names, minus entropy_coeff x the entropy and plus kl_loss_coef x the KL, each
    aggregated by agg_loss with the global batch's counts. Called as
    ``ppo_loss(config, {"log_probs": ..., "entropy": ...}, padded_batch(...))`` on padded
    [B, T] tensors (its no-padding conversion is then the identity)."""
    ns = verl_functions("kl_penalty", "kl_penalty_forward",
                        *(f"compute_policy_loss_{m}" for m in POLICY_MODES))
    metric = type("Metric", (), {"__init__": lambda self, value=None, aggregation=None: None,
                                 "from_dict": staticmethod(lambda d, aggregation=None: d)})
    ns.update(no_padding_2_padding=lambda x, data: x, Metric=metric, TensorDict=dict,
              AggregationType=SimpleNamespace(SUM="sum", MEAN="mean"),
              get_policy_loss_fn=lambda mode: ns[f"compute_policy_loss_{mode}"])
    _source("workers/utils/losses.py", ("ppo_loss",), ns)
    return ns["ppo_loss"]


def padded_batch(mask, old, adv, ref=None, tokens=None, rows=None) -> _Padded:
    """The batch ppo_loss reads: one process, the global batch's ``tokens`` and ``rows``
    (None: this batch's own, as agg_loss then counts them)."""
    data = _Padded(dp_size=1, batch_num_tokens=tokens, global_batch_size=rows,
                   response_mask=mask, old_log_probs=old,
                   advantages=adv if adv.dim() == 2 else adv[:, None].expand_as(old))
    if ref is not None:
        data["ref_log_prob"] = ref
    return data


def verl_apply_kl_penalty() -> dict[str, Any]:
    """verl 0.9.1's ``trainer/ppo/ray_trainer.py::apply_kl_penalty`` (use_kl_in_reward) as it
    is, beside core_algos' outcome estimators; it takes ``data`` with a ``batch`` dict."""
    ns = verl_functions("kl_penalty", "kl_penalty_forward", "compute_grpo_outcome_advantage",
                        "compute_rloo_outcome_advantage", "compute_gpg_outcome_advantage",
                        "compute_reinforce_plus_plus_outcome_advantage",
                        "compute_reinforce_plus_plus_baseline_outcome_advantage")
    ns.update(core_algos=SimpleNamespace(kl_penalty=ns["kl_penalty"], AdaptiveKLController=object),
              DataProto=object, masked_mean=ns["verl_F"].masked_mean)
    _source("trainer/ppo/ray_trainer.py", ("apply_kl_penalty",), ns)
    return ns
