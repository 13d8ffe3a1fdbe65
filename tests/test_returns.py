"""REINFORCE++ and REINFORCE++-baseline (``grpolab.core.returns``): hand-computed values, and
verl's own ``core_algos`` functions on identical inputs (run from verl's source file as it is:
importing the package would need ray, so the functions are executed in a namespace of their
own, with verl's ``masked_whiten`` beside them)."""

from __future__ import annotations

import ast
import importlib.util
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from grpolab.core.returns import (
    masked_whiten,
    reinforce_pp,
    reinforce_pp_baseline,
    token_rewards,
)


def verl_functions(*names: str) -> dict[str, Any]:
    """verl 0.9's functions ``names`` from trainer/ppo/core_algos.py and utils/
    torch_functional.py, executed as written (decorators left off)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("verl is not installed: pip install --no-deps verl==0.9.1 (.ci/run does)")
    root = Path(spec.submodule_search_locations[0])
    ns: dict[str, Any] = {"torch": torch, "defaultdict": defaultdict, "Optional": Optional,
                          "AlgoConfig": Any}
    helpers = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")
    for file, wanted in (("utils/torch_functional.py", helpers),
                         ("trainer/ppo/core_algos.py", names)):
        tree = ast.parse((root / file).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                node.decorator_list = []
                exec(compile(ast.Module([node], []), file, "exec"), ns)  # noqa: S102 - verl's code
    ns["verl_F"] = SimpleNamespace(**{h: ns[h] for h in helpers if h in ns})
    return ns


def batch(seed: int = 0, b: int = 8, t: int = 6) -> tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor, torch.Tensor]:
    """Rewards [B] (0/1), a ragged mask, a per-token penalty and group ids (groups of 4, one
    group of 1 when b is odd)."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    lens = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]).long()
    pen = 0.05 * torch.randn(b, t, generator=g) * mask
    ids = torch.arange(b) // 4
    return rewards, mask, pen, ids


def test_token_rewards_put_the_outcome_on_the_last_real_token() -> None:
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    got = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask)
    assert got.tolist() == [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]]
    pen = torch.full((3, 4), 0.1)
    got = token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask, pen)
    assert got[0].tolist() == pytest.approx([-0.1, -0.1, 0.9, 0.0])
    assert got[1].tolist() == pytest.approx([1.9, 0, 0, 0]) and not got[2].any()


def test_returns_and_whitening_by_hand() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    r = token_rewards(torch.tensor([1.0, 0.0]), mask)
    # gamma 1: every real token of row 0 returns 1, of row 1 returns 0; mean 0.4 over 5
    # tokens, unbiased variance (2 x 0.36 + 3 x 0.16) / 4 = 0.3
    got = reinforce_pp(r, mask, gamma=1.0)
    s = math.sqrt(0.3 + 1e-8)
    assert got.flatten().tolist() == pytest.approx([0.6 / s, 0.6 / s, 0] + [-0.4 / s] * 3)
    # gamma 0.5: row 0 returns 0.5, 1; row 1 zeros
    got = reinforce_pp(r, mask, gamma=0.5)
    x = torch.tensor([0.5, 1, 0, 0, 0])
    want = (x - x.mean()) / torch.sqrt(x.var() + 1e-8)
    assert got[mask.bool()].tolist() == pytest.approx(want.tolist())
    # gamma 0: only the last token has a return
    assert reinforce_pp(r, mask, gamma=0.0)[0, 0] == reinforce_pp(r, mask, gamma=0.0)[1, 0]


def test_baseline_centres_each_group_and_leaves_a_group_of_one() -> None:
    mask = torch.ones(5, 2, dtype=torch.long)
    r = token_rewards(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0]), mask)
    ids = torch.tensor([0, 0, 0, 0, 1])  # a group of 4 and a group of 1
    got = reinforce_pp_baseline(r, mask, ids)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 1.0]).repeat_interleave(2)
    want = (centred - centred.mean()) / torch.sqrt(centred.var() + 1e-8)
    assert got.flatten().tolist() == pytest.approx(want.tolist(), abs=1e-6)
    dead = reinforce_pp_baseline(token_rewards(torch.ones(4), torch.ones(4, 2)), torch.ones(4, 2),
                                 torch.zeros(4, dtype=torch.long))
    assert not dead.any()  # a group whose rewards are equal: all zero


def test_whitening_over_ranks_is_the_whole_batchs() -> None:
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    m = torch.ones(6, 4)
    whole = masked_whiten(x, m)
    # two "ranks" of 3 rows each, their sums added by reduce
    halves = [(x[:3], m[:3]), (x[3:], m[3:])]
    sums: list[list[float]] = []

    def reduce(values: list[float]) -> list[float]:
        sums.append(values)
        if len(sums) == 1:  # n and sum
            return [float(m.sum()), float(x.sum())]
        return [float(((x - x.mean()) ** 2).sum())]

    got = masked_whiten(halves[0][0], halves[0][1], reduce)
    torch.testing.assert_close(got, whole[:3])


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_equals_verl(gamma: float, seed: int) -> None:
    verl = verl_functions("compute_reinforce_plus_plus_outcome_advantage")
    rewards, mask, pen, _ = batch(seed)
    tr = token_rewards(rewards, mask, pen)
    want, _ = verl["compute_reinforce_plus_plus_outcome_advantage"](
        tr, mask.float(), config=SimpleNamespace(gamma=gamma))
    torch.testing.assert_close(reinforce_pp(tr, mask, gamma=gamma), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b", [8, 9])  # 9: a group of one at the end
@pytest.mark.parametrize("seed", [0, 1])
def test_reinforce_pp_baseline_equals_verl(b: int, seed: int) -> None:
    verl = verl_functions("compute_reinforce_plus_plus_baseline_outcome_advantage")
    rewards, mask, pen, ids = batch(seed, b=b)
    tr = token_rewards(rewards, mask, pen)
    want, _ = verl["compute_reinforce_plus_plus_baseline_outcome_advantage"](
        tr.clone(), mask.float(), ids.tolist())
    torch.testing.assert_close(reinforce_pp_baseline(tr, mask, ids), want, atol=1e-5, rtol=1e-5)


def first_digit_odd(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return [float(bool(c) and c[0] in "13579") for c in completions]


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_trainer_takes_the_token_level_step(tmp_path: Path, estimator: str) -> None:
    """A step with the per-token KL in the reward: the trainer's advantages are the estimator's
    on the policy's and reference's own log-probs, the loss is finite, samples.jsonl gets one
    advantage per answer and the KL penalty is reported."""
    from grpolab.config import Config, resolve
    from grpolab.core.losses import KL_ESTIMATORS
    from grpolab.core.returns import ESTIMATORS
    from grpolab.run.trainer import GRPOTrainer
    from grpolab.world.backend import TinyBackend
    from grpolab.world.model import TinyConfig, TinyGPT
    from grpolab.world.task import make_splits

    torch.manual_seed(0)
    cfg = resolve(Config(budget=32, group_size=4, progress=False, out_dir=str(tmp_path),
                         estimator=estimator, kl_in="reward", kl_estimator="k1", beta=0.5,
                         checkpoint_every=0, steps=1, log_samples=8))
    backend = TinyBackend(TinyGPT(TinyConfig(d_model=32, n_layers=2)))  # a frozen reference copy
    tr = GRPOTrainer(cfg, backend, make_splits(0, 64, 8).train, [first_digit_odd],
                     out_dir=tmp_path)
    with torch.no_grad():  # move the policy away from its frozen copy
        for p in backend.model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = tr.collect()
    scored = tr.score(batch)
    adv = tr.advantages(batch, scored)
    ro, m = batch.rollout, batch.rollout.completion_mask
    with torch.no_grad():
        kl = KL_ESTIMATORS["k1"](backend.logprobs(ro, 1.0), backend.logprobs(ro, 1.0, True))
    want = ESTIMATORS[estimator](token_rewards(batch.rewards, m, 0.5 * kl * m), m,
                                 torch.arange(32) // 4)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    assert adv.shape == m.shape and not adv[m == 0].any()
    out = tr.optimize(scored, adv)
    assert math.isfinite(out["loss"]) and out["kl"] == 0.0
    assert out["kl_reward"] == pytest.approx(float((0.5 * kl * m).sum(-1).mean()), rel=1e-5)
    tr.samples = tr.metrics = None
    from grpolab.run.report import MetricsWriter

    tr.samples = MetricsWriter(tmp_path / "samples.jsonl", None, "test")
    tr.step()
    group = tr.last_samples[0]
    assert len(group["advantages"]) == 4 and all(isinstance(a, float)
                                                 for a in group["advantages"])
