"""Issue 15: ragged groups, Beta pass-rate posteriors, the allocator and the no-signal alarm."""

import itertools
import json
import logging
import math
from collections.abc import Callable

import pytest
import torch
import yaml
from helpers import first_digit_odd, never
from helpers import world_trainer as shared_world_trainer

from grpolab.config import ConfigError, make_config
from grpolab.core import advantages as A
from grpolab.predict.alarm import NoSignalAlarm, diagnose
from grpolab.predict.allocate import (
    ALLOCATION_OBJECTIVES,
    allocate,
    allocate_by_kind,
    allocate_table,
    kind_quotas,
    size_axis,
)
from grpolab.predict.posterior import (
    GridPassRateTracker,
    PassRateTracker,
    brier_score,
    calibration_summary,
    dead_probability,
    fit_beta_prior,
    fit_grid_prior,
    reliability_table,
)
from grpolab.run.trainer import GRPOTrainer

# ------------------------------------------------------------------ ragged groups --


def test_ragged_advantages_hand_values() -> None:
    # group 0: two answers [1, 0]; group 1: four answers [1, 1, 0, 0]... and a dead group [1, 1]
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 3.0, 3.0])
    ids = A.group_ids_from_sizes([2, 4, 2])
    assert ids.tolist() == [0, 0, 1, 1, 1, 1, 2, 2]
    # mean 0.5, population std 0.5 -> +-1; group 1: mean 0.75, std sqrt(3)/4
    s = math.sqrt(3) / 4
    want = [1, -1, 0.25 / s, 0.25 / s, 0.25 / s, -0.75 / s, 0, 0]
    assert A.group_advantages_ragged(r, ids).tolist() == pytest.approx(want)
    # Dr. GRPO (no scale): r - mean
    assert A.group_advantages_ragged(r, ids, scale="none").tolist() == pytest.approx(
        [0.5, -0.5, 0.25, 0.25, 0.25, -0.75, 0, 0])
    # RLOO: r - mean of the others (group of 2: the other one; group 1: 2/3 or 1)
    assert A.group_advantages_ragged(r, ids, baseline="rloo", scale="none").tolist() == (
        pytest.approx([1, -1, 1 - 2 / 3, 1 / 3, 1 / 3, -1, 0, 0]))
    # sample std: group 0 sqrt(0.5), group 1 sqrt(0.25)
    assert A.group_advantages_ragged(r, ids, std="sample").tolist()[:3] == pytest.approx(
        [0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), 0.25 / 0.5])
    assert A.dead_mask_ragged(r, ids).tolist() == [False, False, True]
    ds = A.dead_stats_ragged(r, ids)
    assert (ds.groups, ds.dead, ds.all_right, ds.all_wrong) == (3, 1, 1, 0)
    # ids need not be contiguous or sorted: the same groups, shuffled
    perm = torch.tensor([7, 2, 0, 5, 1, 4, 6, 3])
    shuffled = A.group_advantages_ragged(r[perm], ids[perm] * 3 + 1)
    assert shuffled.tolist() == pytest.approx([want[i] for i in perm.tolist()])
    # a group of one answer is dead
    assert A.group_advantages_ragged(torch.tensor([1.0, 0.0, 1.0]),
                                     A.group_ids_from_sizes([2, 1])).tolist() == [1, -1, 0]



def expected_value(a: torch.Tensor, b: torch.Tensor, sizes: list[int],
                   objective: str = "live_groups") -> float:
    """The objective of an allocation: prompts' posteriors a, b [K] and their sizes [K]."""
    n = torch.as_tensor(sizes, dtype=torch.float64)
    dead = dead_probability(torch.as_tensor(a, dtype=torch.float64),
                            torch.as_tensor(b, dtype=torch.float64), n)
    return float(ALLOCATION_OBJECTIVES[objective](n, dead).sum())


@pytest.mark.parametrize("baseline", ["mean", "rloo"])
@pytest.mark.parametrize("scale", ["std", "batch", "none"])
@pytest.mark.parametrize("std", ["population", "sample"])
def test_ragged_equals_fixed_reshape_for_equal_sizes(baseline: str, scale: str, std: str) -> None:
    g = torch.Generator().manual_seed(0)
    r = torch.randint(0, 3, (24,), generator=g).float()
    r[:4] = 1.0  # one dead group
    opts = {"baseline": baseline, "scale": scale, "std": std, "std_eps": 1e-6}
    fixed = A.group_advantages(r, 4, **opts)
    ragged = A.group_advantages_ragged(r, A.group_ids_from_sizes([4] * 6), **opts)
    assert torch.allclose(fixed, ragged, atol=1e-6)
    assert torch.equal(A.dead_mask_ragged(r, A.group_ids_from_sizes([4] * 6)), A.dead_mask(r, 4))
    per_fn = torch.stack([r, (r > 1).float()], 1)
    w = torch.tensor([1.0, 0.5])
    for name, fn in A.REWARD_AGGREGATIONS.items():
        ragged_fn = A.RAGGED_REWARD_AGGREGATIONS[name]
        assert torch.allclose(fn(per_fn, w, 4, **opts),
                              ragged_fn(per_fn, w, A.group_ids_from_sizes([4] * 6), **opts),
                              atol=1e-6)


# ----------------------------------------------------------------- posteriors --


def test_dead_probability_hand_values_and_monte_carlo() -> None:
    # uniform prior: E[p^G] = 1/(G+1), so P(dead) = 2/(G+1)
    for n in (2, 4, 8, 16):
        assert float(dead_probability(torch.tensor([1.0]), torch.tensor([1.0]), n)) == (
            pytest.approx(2 / (n + 1)))
    # Beta(2, 1): E[p^2] = 2/4 = 1/2, E[(1-p)^2] = 2/(3*4) = 1/6
    assert float(dead_probability(torch.tensor([2.0]), torch.tensor([1.0]), 2)) == (
        pytest.approx(2 / 3))
    a = torch.tensor([0.3, 2.0, 5.0, 0.7])
    b = torch.tensor([0.9, 3.0, 1.0, 20.0])
    n = torch.tensor([4, 8, 16, 6])
    p = torch.distributions.Beta(a, b).sample((200_000,)).double()
    mc = (p**n + (1 - p) ** n).mean(0)
    assert torch.allclose(dead_probability(a, b, n), mc, atol=5e-3)
    # a known pass rate p, group of n: p^n + (1-p)^n; one answer is always a dead group
    got = A.group_dead_probability(torch.tensor([0.5, 1.0, 0.2, 0.3]), [2, 4, 1, 3])
    assert got.tolist() == pytest.approx([0.5, 1.0, 1.0, 0.3**3 + 0.7**3])


def test_prior_fit_recovers_the_population() -> None:
    torch.manual_seed(0)
    p = torch.distributions.Beta(torch.tensor(0.4), torch.tensor(1.2)).sample((4000,))
    s = torch.distributions.Binomial(8, p).sample()
    a0, b0 = fit_beta_prior(s, 8 - s)
    assert a0 / (a0 + b0) == pytest.approx(0.25, abs=0.02)
    assert a0 + b0 == pytest.approx(1.6, rel=0.15)
    assert fit_beta_prior(s, 8 - s, strength=10.0)[0] == pytest.approx(10 * 0.25, abs=0.2)
    assert fit_beta_prior(torch.tensor([1.0]), torch.tensor([3.0])) == (1.0, 1.0)  # one prompt


@pytest.mark.parametrize("decay", [1.0, 0.97, 0.74])
def test_prior_fit_on_decayed_evidence_of_every_age(decay: float) -> None:
    """The tracker fits its prior to decayed counts, answers of different ages weighing
    decay^age: the binomial noise it subtracts is the weights' (sum of squares / sum per
    prompt), not one per prompt, so the population's spread is found at any decay (it came
    out up to 10x too narrow: a0 + b0 at its 200 cap for decay 0.74)."""
    torch.manual_seed(0)
    p = torch.distributions.Beta(torch.tensor(6.0), torch.tensor(14.0)).sample((4000,))
    t = PassRateTracker(4000, decay=decay)
    for half in (torch.arange(0, 2000), torch.arange(2000, 4000)):  # seen 4 and 1 steps ago
        right = torch.distributions.Binomial(8, p[half]).sample()
        t.observe(half, right, [8] * 2000)
        for _ in range(3 if half[0] == 0 else 1):
            t.end_step()
    a0, b0 = t.prior
    assert a0 / (a0 + b0) == pytest.approx(0.3, abs=0.02)
    assert a0 + b0 == pytest.approx(20.0, rel=0.2)


def test_tracker_observes_decays_and_predicts_before_seeing() -> None:
    t = PassRateTracker(3, decay=0.5, prior_strength=0.0)
    before = t.dead_probability([0, 1], [4, 4])
    assert before.tolist() == pytest.approx([0.4, 0.4])  # uniform prior: 2/5
    t.observe([0, 1, 0], torch.tensor([4.0, 2.0, 0.0]), [4, 4, 4])
    a, b = t.posterior()
    assert a.tolist() == [5, 3, 1] and b.tolist() == [5, 3, 1]
    t.end_step()
    assert t.successes.tolist() == [2, 1, 0] and t.failures.tolist() == [2, 1, 0]
    state = t.state_dict()
    u = PassRateTracker(3)
    u.load_state_dict(state)
    assert u.posterior()[0].tolist() == t.posterior()[0].tolist() and u.prior == t.prior


def test_grid_posterior_hand_values() -> None:
    """Prior weight 1/3 on each of p = 0, 1/2, 1: a prompt with one right and one wrong answer
    can only be at 1/2 (P(dead, n=4) = 2 / 16); a prompt never seen is the prior's mix."""
    tr = GridPassRateTracker(3)
    w = torch.full_like(tr.weights, 1e-300)
    w[[0, 10, 20]] = 1 / 3  # grid 0, 0.05, ..., 1: index 10 is 1/2
    tr.weights = w
    tr.observe([0, 1], torch.tensor([1.0, 2.0]), [2, 2])  # prompt 1: 2 of 2 right
    dead = tr.dead_probability([0, 2, 1], 4)
    assert dead[0] == pytest.approx(0.125)
    assert dead[1] == pytest.approx((1 + 1 + 0.125) / 3)
    # all right twice: p = 1 (prior 1/3, likelihood 1) or 1/2 (1/3, 1/4) -> 4/5 and 1/5
    assert dead[2] == pytest.approx(0.8 + 0.2 * 0.125)
    assert tr.mean([1])[0] == pytest.approx(0.8 + 0.2 * 0.5)
    table = tr.dead_table(torch.tensor([4.0, 6.0]))
    assert table.shape == (3, 2) and table[0, 0] == pytest.approx(0.125)
    assert table[0, 1] == pytest.approx(2 / 64)


def test_grid_prior_recovers_bands_that_one_beta_cannot() -> None:
    """Prompts always right (50%), always wrong (30%) or right 3 times in 4 (20%), each seen
    once with 8 answers: the EM grid prior finds the three bands and predicts an unseen
    prompt's dead chance (exactly 0.8 + 0.2 (0.75^8 + 0.25^8) = 0.820) far better than the
    moment-fitted Beta."""
    g = torch.Generator().manual_seed(0)
    n = 2000
    p = torch.cat([torch.ones(n // 2), torch.zeros(3 * n // 10), torch.full((n // 5,), 0.75)])
    s = torch.binomial(torch.full((n,), 8.0), p, generator=g).double()
    f = 8.0 - s
    grid = torch.linspace(0, 1, 21, dtype=torch.float64)
    w = fit_grid_prior(s, f, grid, torch.full((21,), 1 / 21, dtype=torch.float64), iters=500)
    assert w[20] == pytest.approx(0.5, abs=0.02) and w[0] == pytest.approx(0.3, abs=0.02)
    assert float(w[12:18].sum()) == pytest.approx(0.2, abs=0.03)  # 0.6 .. 0.85
    exact = 0.8 + 0.2 * (0.75**8 + 0.25**8)
    grid_dead = float(w @ (grid**8 + (1 - grid) ** 8))
    a0, b0 = fit_beta_prior(s, f)
    beta_dead = float(dead_probability(torch.tensor(a0), torch.tensor(b0), 8))
    assert abs(grid_dead - exact) < 0.01 < abs(beta_dead - exact)


def test_grid_prior_reads_decayed_counts_as_the_answers_they_were() -> None:
    """Counts faded alike (x d, their squared weights x d^2) are the same answers: the grid
    prior fitted to them is the one fitted to the counts before fading (read as fewer answers,
    each rate looked noisier and the prior came out narrower, less mass at 0 and 1)."""
    g = torch.Generator().manual_seed(1)
    p = torch.cat([torch.zeros(60), torch.ones(40), torch.rand(100, generator=g)])
    s = torch.binomial(torch.full((200,), 8.0), p, generator=g).double()
    f, grid, init = 8.0 - s, torch.linspace(0, 1, 21, dtype=torch.float64), torch.full(
        (21,), 1 / 21, dtype=torch.float64)
    whole = fit_grid_prior(s, f, grid, init)
    assert torch.equal(fit_grid_prior(s, f, grid, init, squares=s + f), whole)  # (unfaded)
    d = 0.97**10
    faded = fit_grid_prior(s * d, f * d, grid, init, squares=(s + f) * d * d)
    assert torch.allclose(faded, whole, atol=1e-9)
    raw = fit_grid_prior(s * d, f * d, grid, init)  # (the faded counts as answers)
    assert raw[0] < whole[0] - 0.02 and raw[-1] < whole[-1] - 0.02


def test_grid_tracker_fits_on_end_step_and_round_trips() -> None:
    tr = GridPassRateTracker(4, decay=0.5)
    tr.observe([0, 1, 2], torch.tensor([4.0, 0.0, 4.0]), [4, 4, 4])
    tr.end_step()
    assert tr.successes[0] == pytest.approx(2.0)  # decayed
    assert tr.weights[-1] > tr.weights[10] and tr.weights[0] > tr.weights[10]
    assert tr.prior_summary()[1:] == [round(float(tr.weights[0]), 4),
                                      round(float(tr.weights[-1]), 4)]
    tr2 = GridPassRateTracker(4)
    tr2.load_state_dict(tr.state_dict())
    assert torch.equal(tr2.weights, tr.weights)
    assert torch.equal(tr2.dead_probability([0, 3], 8), tr.dead_probability([0, 3], 8))


def test_brier_and_reliability_hand_values() -> None:
    pred = torch.tensor([0.05, 0.15, 0.95, 0.91, 0.5])
    dead = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0])
    assert brier_score(pred, dead) == pytest.approx(
        (0.05**2 + 0.15**2 + 0.05**2 + 0.91**2 + 0.25) / 5)
    table = reliability_table(pred, dead)
    assert [(b["lo"], b["groups"], b["measured"]) for b in table] == [
        (0.0, 1, 0.0), (0.1, 1, 0.0), (0.5, 1, 1.0), (0.9, 2, 0.5)]
    assert table[-1]["mean_predicted"] == pytest.approx(0.93)
    rows = [{"step": 1, "group_dead_prob": [0.05, 0.15], "group_dead": [0, 0]},
            {"step": 2, "group_dead_prob": [0.95, 0.91, 0.5], "group_dead": [1, 0, 1]}]
    s = calibration_summary(rows)
    assert s["posterior_dead_brier"] == pytest.approx(brier_score(pred, dead))
    assert s["posterior_dead_brier_base_rate"] == pytest.approx(0.24)  # base rate 0.4
    assert s["posterior_dead_groups"] == 5 and len(s["posterior_dead_reliability"]) == 4
    # measured over the same groups (pooled: 2 of 5), not the steps' mean share (1/3 per step)
    assert s["posterior_measured_dead_share"] == pytest.approx(0.4)
    assert s["mean_posterior_dead_share"] == pytest.approx(2.56 / 5)


# ------------------------------------------------------------------ allocation --


def test_allocator_choice_on_hand_made_posteriors() -> None:
    # 0: near 1/2, well known; 1: confidently dead (never solved); 2: hard (p ~ 0.1);
    # 3: unknown (uniform); 4: confidently all right
    a = torch.tensor([50.0, 0.1, 2.0, 1.0, 60.0])
    b = torch.tensor([50.0, 60.0, 18.0, 1.0, 0.1])
    gen = torch.Generator().manual_seed(0)
    idx, sizes = allocate(a, b, 16, 4, 8, generator=gen)
    got = dict(zip(idx, sizes))
    assert sum(sizes) == 16 and all(4 <= n <= 8 for n in sizes)
    # live groups: the p ~ 1/2 prompt first (live almost surely at 4), then the unknown one,
    # then the hard one gets a large group; the confidently dead ones get nothing
    # live groups: the p ~ 1/2 prompt (live almost surely at 4), the unknown one and the hard
    # one (p ~ 0.1) are opened at 4; the 4 answers left go where one more answer buys the most
    # live chance (hand values: unknown 4->5 +0.067, p~1/2 4->5 +0.066, hard 4->5 +0.056,
    # then 5->6 +0.048 / +0.050 ...). The confidently dead or solved prompts get nothing.
    assert got == {0: 5, 3: 5, 2: 6}
    # and no allocation of the 16 answers does better (brute force over every split)
    import itertools

    best = max(expected_value(a, b, list(split)) if sum(split) == 16 else -1
               for split in itertools.product([0, 4, 5, 6, 7, 8], repeat=5))
    assert expected_value(a[idx], b[idx], sizes) == pytest.approx(best)
    # live answers: fewer, larger groups on the likely-live prompts
    idx2, sizes2 = allocate(a, b, 16, 4, 8, objective="live_answers", generator=gen)
    assert dict(zip(idx2, sizes2)) == {0: 8, 3: 8}
    # a budget that is no multiple of min_size is spent exactly
    assert sum(allocate(a, b, 18, 4, 8, generator=gen)[1]) == 18


def test_allocator_with_one_group_size_and_a_table_of_the_wrong_width() -> None:
    a, b = torch.ones(10), torch.ones(10)
    idx, sizes = allocate(a, b, 24, 4, 4)  # min == max: groups of exactly 4
    assert sizes == [4] * 6 and len(set(idx)) == 6
    with pytest.raises(ValueError, match="one column per size"):
        allocate_table(torch.zeros(10, 3), 24, 4, 8)


def test_allocator_explores_and_respects_limits() -> None:
    n = 200
    a = torch.full((n,), 0.05)
    b = torch.full((n,), 50.0)  # every prompt confidently dead ...
    a[7], b[7] = 5.0, 5.0  # ... but one
    seen = set()
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        idx, sizes = allocate(a, b, 32, 4, 16, explore=0.25, generator=gen)
        assert 7 in idx and sum(sizes) == 32 and len(set(idx)) == len(idx)
        seen |= set(idx) - {7}
    assert len(seen) > 20  # exploration visits dead prompts, different ones each step
    # without exploration the live prompt gets the largest group; the budget is still spent
    got = dict(zip(*allocate(a, b, 32, 4, 16, generator=gen)))
    assert got[7] == 16 and sum(got.values()) == 32
    # too few prompts to spend the budget: every prompt at max_size, the rest unspent
    assert allocate(a[:2], b[:2], 64, 4, 8, generator=gen)[1] == [8, 8]


def test_exploration_is_its_share_on_average_per_kind_too() -> None:
    """explore 0.1 of 64 answers at size 4 is 1.6 groups: one, and a second 60% of the time
    (it was one, 6.25%); per kind of a 16-answer quota 0.4 groups (it was none, ever)."""
    n = 400
    live = torch.arange(n) < n // 2  # half certainly live, half certainly dead
    a = torch.where(live, 5.0, 0.01).double()
    b = torch.where(live, 5.0, 100.0).double()
    kinds = torch.arange(n) % 4
    dead = dead_probability(a[:, None], b[:, None], size_axis(4, 16)[None, :])
    gen = torch.Generator().manual_seed(2)
    spent = {"plain": 0.0, "by_kind": 0.0}
    for _ in range(300):
        for how, (idx, sizes) in (("plain", allocate_table(dead, 64, 4, 16, explore=0.1,
                                                           generator=gen)),
                                  ("by_kind", allocate_by_kind(dead, kinds, 64, 4, 16,
                                                               explore=0.1, generator=gen))):
            assert sum(sizes) == 64
            spent[how] += sum(z for i, z in zip(idx, sizes) if not live[i]) / 64 / 300
    # explored prompts are random: half of them the dead ones, which get nothing otherwise
    assert spent["plain"] == pytest.approx(0.05, abs=0.01)
    assert spent["by_kind"] == pytest.approx(0.05, abs=0.01)


def test_kind_quotas_hand_values() -> None:
    four = torch.tensor([0] * 50 + [1] * 50 + [2] * 50 + [3] * 50)
    assert kind_quotas(four, 32, 4) == [8, 8, 8, 8]
    # 3:1 prompts, 7 groups of 4: 5.25 / 1.75 -> 5 + 2 groups (largest remainder), the 2
    # answers left over go to the larger kind
    assert kind_quotas(torch.tensor([0, 0, 0, 1]), 30, 4) == [22, 8]
    # a kind whose share is under one group gets none; the total is always the budget
    assert kind_quotas(torch.tensor([0] + [1] * 9), 16, 4) == [0, 16]


def test_allocate_by_kind_keeps_the_hard_kind_its_share() -> None:
    """Kind 0: prompts near p = 1/2; kind 1: prompts confidently dead but one (p ~ 0.1).
    Plain allocation spends every answer on kind 0; per kind, kind 1 keeps half the budget
    and spends it on its likeliest prompt first."""
    kinds = torch.tensor([0] * 6 + [1] * 6)
    a = torch.tensor([20.0] * 6 + [0.1] * 5 + [2.0])
    b = torch.tensor([20.0] * 6 + [40.0] * 5 + [18.0])
    dead = dead_probability(a[:, None], b[:, None], torch.arange(4, 9, dtype=torch.float64))
    gen = torch.Generator().manual_seed(0)
    idx, sizes = allocate_table(dead, 16, 4, 8, generator=gen)
    assert all(i < 6 for i in idx) and sum(sizes) == 16
    idx, sizes = allocate_by_kind(dead, kinds, 16, 4, 8, generator=gen)
    got = dict(zip(idx, sizes))
    assert sum(n for i, n in got.items() if i < 6) == 8
    assert sum(n for i, n in got.items() if i >= 6) == 8
    # the hint prompt's group grows before a dead prompt is opened (hand values: 4->5 adds
    # 0.044 live chance, opening a dead prompt at 4 adds 0.0023 per answer)
    assert got[11] == 8 and len(idx) == len(set(idx))


# ---------------------------------------------------------------------- alarm --


def test_alarm_diagnoses() -> None:
    assert diagnose(8, 7, 3, 4, 0.1, 8) is None
    assert diagnose(8, 8, 0, 8, 0.0, 8)[0] == "all_wrong"
    assert diagnose(8, 8, 8, 0, 0.0, 8)[0] == "all_right"
    cause, msg = diagnose(8, 8, 3, 5, None, 8)  # binary rewards, polarised prompts
    assert cause == "polarised" and "3 all right, 5 all wrong" in msg and "group_size" in msg
    # a reward constant at 0.5 (below success_threshold 1): all wrong, the constant named
    assert "the reward is constant" in diagnose(8, 8, 0, 8, None, 8)[1]
    # the truncation check: at the threshold it fires; above 1 it is off
    assert diagnose(8, 2, 0, 2, 1.0, 8, truncated_threshold=1.0)[0] == "truncated"
    assert diagnose(8, 8, 0, 8, 1.0, 8, truncated_threshold=1.01)[0] == "all_wrong"
    # answers no reward scored (TRL's None): said before truncation, which it is not
    assert diagnose(8, 8, 0, 8, 1.0, 8, unscored_share=0.9)[0] == "unscored"
    assert diagnose(8, 8, 0, 8, 1.0, 8, unscored_share=0.2)[0] == "truncated"
    cause, msg = diagnose(8, 8, 0, 8, 1.0, 16)
    assert cause == "truncated" and "max_new_tokens=16" in msg
    assert "advantages zero" in msg and "every group is dead" in msg
    cause, msg = diagnose(8, 2, 0, 2, 0.95, 16)  # even with live groups (a length reward) ...
    assert cause == "truncated" and "(2/8 groups dead)" in msg and "6 live group(s)" in msg
    assert "advantages zero" not in msg and "rewards are equal" not in msg  # ... said truly
    assert diagnose(8, 2, 0, 2, 0.95, 16, truncated_threshold=1.01) is None  # off


def test_alarm_rate_limits(caplog: pytest.LogCaptureFixture) -> None:
    alarm = NoSignalAlarm()
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        for step in range(1, 13):
            alarm.check(step, 4, 4, 0, 4, 0.0, 8)
    assert caplog.text.count("NO LEARNING SIGNAL") == 2  # steps 1 and 11
    with caplog.at_level(logging.WARNING, logger="grpolab"):  # cut off, two groups live
        NoSignalAlarm().check(1, 4, 2, 0, 2, 0.95, 8)
    assert caplog.records[-1].getMessage().startswith("LITTLE LEARNING SIGNAL at step 1")


def _alarm_warnings(caplog: pytest.LogCaptureFixture, alarms: list[tuple[NoSignalAlarm, range]],
                    truncated: Callable[[int], float]) -> list[str]:
    """The warnings of alarms checked in turn over their steps, every group all wrong (4 of 4
    dead), ``truncated(step)`` of the answers cut off."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        for alarm, steps in alarms:
            for step in steps:
                alarm.check(step, 4, 4, 0, 4, truncated(step), 8)
    return [r.getMessage() for r in caplog.records]


def test_alarm_state_resumes_its_rate_limit(caplog: pytest.LogCaptureFixture) -> None:
    """Stopped after step 5 and resumed from its state, the alarm warns at the steps an
    uninterrupted one does (1 and 11), counting the steps without signal from the start."""
    def warnings(alarms: list[tuple[NoSignalAlarm, range]]) -> list[str]:
        return [m[:50] for m in _alarm_warnings(caplog, alarms, lambda step: 0.0)]

    whole = warnings([(NoSignalAlarm(), range(1, 13))])
    first, second = NoSignalAlarm(), NoSignalAlarm()
    before = warnings([(first, range(1, 6))])
    second.load_state_dict(first.state_dict())
    assert before + warnings([(second, range(6, 13))]) == whole
    assert "at step 11 (11 step(s)" in whole[1]


def test_alarm_rate_limits_each_cause_when_causes_flip(caplog: pytest.LogCaptureFixture) -> None:
    """A cause flipping between two at every step warns about each at most every
    REPEAT_EVERY steps (each cause's first time at once), not at every flip."""
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        alarm = NoSignalAlarm()
        for step in range(1, 25):
            alarm.check(step, 4, 4, 0, 4, 0.95 if step % 2 else 0.0, 8)
    said = [(int(m.split(" at step ")[1].split()[0]), "max_new_tokens" in m)
            for m in (r.getMessage() for r in caplog.records)]
    # truncated at 1, 11, 21; all wrong at 2, 12, 22
    assert said == [(1, True), (2, False), (11, True), (12, False), (21, True), (22, False)]


def test_alarm_flips_resume_as_uninterrupted(caplog: pytest.LogCaptureFixture) -> None:
    """Stopped mid-flip and resumed from its state, each cause's limit carries on; a state
    of the older form (last_step, last_cause) still loads."""
    def run(alarms: list[tuple[NoSignalAlarm, range]]) -> list[str]:
        return [m[:45] for m in _alarm_warnings(caplog, alarms,
                                                 lambda step: 0.95 if step % 2 else 0.0)]

    whole = run([(NoSignalAlarm(), range(1, 25))])
    first, second = NoSignalAlarm(), NoSignalAlarm()
    before = run([(first, range(1, 8))])
    second.load_state_dict(first.state_dict())
    assert before + run([(second, range(8, 25))]) == whole
    old = NoSignalAlarm()  # a checkpoint written before causes were limited apart
    old.load_state_dict({"last_step": 7, "last_cause": "truncated", "steps_without": 7})
    assert old.state_dict() == {"last_warned": {"truncated": 7}, "steps_without": 7}
    said = run([(old, range(8, 18))])  # truncated was warned of at 7: next due at 17
    assert [m.split(" (")[0] for m in said] == ["NO LEARNING SIGNAL at step 8",
                                                 "NO LEARNING SIGNAL at step 17"]


def world_trainer(tmp_path, reward=first_digit_odd, **over) -> GRPOTrainer:
    return shared_world_trainer(tmp_path, reward, max_len=16, **{"eval_size": 8, **over})


def test_alarm_fires_on_an_all_truncated_step(tmp_path, caplog) -> None:
    # one token of room: a random model almost never ends its answer at once
    tr = world_trainer(tmp_path, max_new_tokens=1)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        rec = tr.step()
    assert rec["sampled_truncated_share"] > 0.9
    assert rec["no_signal"] == "truncated"
    # (a one-token answer's first digit still varies: some groups may be live, "LITTLE")
    assert "LEARNING SIGNAL at step 1" in caplog.text and "max_new_tokens=1" in caplog.text


def test_alarm_fires_on_an_all_dead_step(tmp_path, caplog) -> None:
    tr = world_trainer(tmp_path, reward=never)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        rec = tr.step()
    assert rec["dead_share"] == 1.0 and rec["no_signal"] == "all_wrong"
    assert "all 8 groups are all wrong" in caplog.text


# ------------------------------------------------------------- in the trainer --


def test_posterior_prediction_logged_per_group(tmp_path) -> None:
    tr = world_trainer(tmp_path)
    rec = tr.step()
    assert len(rec["group_dead_prob"]) == len(rec["group_dead"]) == rec["groups"] == 8
    assert rec["posterior_dead_share"] == pytest.approx(0.4, abs=1e-4)  # uniform prior, G=4
    assert rec["dead_share"] == pytest.approx(sum(rec["group_dead"]) / 8)
    rec2 = tr.step()  # the prior is now fitted to step 1's groups
    assert rec2["posterior_prior"] != [1.0, 1.0]
    assert tr.tracker.successes.sum() > 0


def test_allocate_trains_ragged_groups_within_the_budget(tmp_path) -> None:
    tr = world_trainer(tmp_path, allocate=True, allocate_min_group=2, allocate_max_group=8,
                       allocate_explore=0.0, log_samples=3)
    from grpolab.run.report import MetricsWriter

    tr.samples = MetricsWriter(tmp_path / "samples.jsonl")
    recs = [tr.step() for _ in range(3)]
    for rec in recs:
        assert rec["answers_generated"] == 32 == sum(rec["group_sizes"])
        assert rec["groups"] == len(rec["group_sizes"]) == len(rec["group_dead"])
        live = [n for n, d in zip(rec["group_sizes"], rec["group_dead"]) if not d]
        assert rec["useful_answers"] == sum(live)
        assert math.isfinite(rec["loss"]) and rec["predicted_dead_share"] is not None
    assert any(len(set(r["group_sizes"])) > 1 for r in recs)  # groups of different sizes
    logged = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert all(len(g["completions"]) == len(g["advantages"]) for s in logged for g in s["groups"])


def test_allocate_on_the_grid_prior_trains(tmp_path) -> None:
    tr = world_trainer(tmp_path, allocate=True, predict_prior="grid", allocate_min_group=2,
                       allocate_max_group=8)
    recs = [tr.step() for _ in range(3)]
    assert isinstance(tr.tracker, GridPassRateTracker)
    assert all(r["answers_generated"] == 32 == sum(r["group_sizes"]) for r in recs)
    assert len(recs[-1]["posterior_prior"]) == 3 and math.isfinite(recs[-1]["loss"])


def test_allocate_with_dynamic_sampling_fills_the_budget_with_live_ragged_groups(
        tmp_path) -> None:
    """Ragged dynamic sampling: refill rounds until live groups hold the budget of answers (a
    group that would overflow it is left out), train on those only, and count every answer."""
    tr = world_trainer(tmp_path, allocate=True, dynamic_sampling=True, allocate_min_group=2,
                       allocate_max_group=8, allocate_explore=0.0, max_sampling_rounds=6)
    kept = []
    orig = tr.rollouts.collect

    def spy(step: int = 0):
        b = orig(step)
        kept.append(b)
        return b

    tr.rollouts.collect = spy
    recs = [tr.step() for _ in range(3)]
    for rec, b in zip(recs, kept):
        sizes = b.group_sizes
        assert sum(sizes) == len(b.rows) == b.rewards.numel() and len(sizes) == b.trained_groups
        assert 32 - 2 < sum(sizes) <= 32 or b.cap_hit
        start, prompts = 0, []
        for n in sizes:  # every trained group is live, and its rows are one prompt's
            r = b.rewards[start:start + n]
            assert r.max() > r.min()
            assert len({row["prompt"] for row in b.rows[start:start + n]}) == 1
            prompts.append(b.rows[start]["prompt"])
            start += n
        # a refill allocates among the prompts the step has not had (the posteriors, having
        # just seen the kept ones live, chose a third of them again)
        assert len(set(prompts)) == len(prompts)
        starts = [0, *itertools.accumulate(rec["group_sizes"])][:-1]  # every sampled group
        sampled = [b.sampled_rows[i]["prompt"] for i in starts]
        assert len(set(sampled)) == len(sampled) <= 64  # (64 training prompts: none twice)
        assert rec["answers_generated"] == sum(rec["group_sizes"]) >= sum(sizes)
        assert rec["useful_answers"] == sum(sizes)  # the live answers trained on
        assert math.isfinite(rec["loss"])
    assert any(b.rounds > 1 for b in kept)  # refills happened


def test_allocate_config_checks() -> None:
    with pytest.raises(ConfigError, match="cannot be combined with curriculum"):
        make_config(None, {"allocate": True, "curriculum": True})
    with pytest.raises(ConfigError, match="allocate_min_group"):
        make_config(None, {"allocate_min_group": 8, "allocate_max_group": 4})
    with pytest.raises(ConfigError, match="allocate_by_kind needs predict_group_by"):
        make_config(None, {"allocate": True, "allocate_by_kind": True})
    from grpolab.config import Config
    from grpolab.world.workshop import variant_settings

    assert variant_settings("allocate") == {"allocate": True}
    assert "posteriors" in Config.__dataclass_fields__["allocate"].metadata["help"]


# --------------------------------------------------------- Hugging Face tiny run --


def test_hf_run_logs_predicted_vs_measured_with_calibration(tmp_path, monkeypatch,
                                                         capsys) -> None:
    pytest.importorskip("transformers")
    from grpolab.app import cli
    from grpolab.rollout.tinyhf import make_tiny_model

    model = make_tiny_model(tmp_path / "llama", arch="llama", hidden=32, heads=4)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} + {b}?", "solution": str(a + b)})
                            + "\n" for a, b in [(3, 4), (12, 7), (25, 17), (8, 9)]))
    out = tmp_path / "run"
    cfg = {"model_path": model, "dataset": str(data), "prompt_column": "question",
           "answer_column": "solution", "rewards": ["format"], "format_pattern": r".*7.*",
           "steps": 3, "budget": 8, "group_size": 4, "max_new_tokens": 8, "eval_size": 2,
           "out_dir": str(out), "progress": False, "checkpoint_every": 0}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml")]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    for r in rows:
        assert r["predicted_dead_share"] is None  # no exact pass rate for a real model ...
        assert 0 <= r["posterior_dead_share"] <= 1  # ... but the posteriors predict it
        assert len(r["group_dead_prob"]) == r["groups"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["posterior_dead_groups"] == 6
    assert 0 <= summary["posterior_dead_brier"] <= 1
    said = capsys.readouterr().out
    assert (f"measured {summary['posterior_measured_dead_share']:.3f} (over the same 6 groups)"
            in said)
    assert sum(b["groups"] for b in summary["posterior_dead_reliability"]) == 6
    assert (out / "calibration.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("tracker", [PassRateTracker, GridPassRateTracker])
def test_kinds_share_evidence_with_prompts_not_seen(tracker: type[PassRateTracker]) -> None:
    """Prompts 0-3 of kind 0 are right half the time, 4-7 of kind 1 never: after one step the
    unseen prompt 3 is predicted live (P(dead) < 0.1) and 7 dead (> 0.75), where one prior for
    all predicts both alike (both ~0.34-0.46); a checkpoint's state restores the kinds'
    priors."""
    kinds = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    seen, right = [0, 1, 2, 4, 5, 6], torch.tensor([4.0, 3, 5, 0, 0, 0])
    grouped, pooled = tracker(8, decay=1.0, kinds=kinds), tracker(8, decay=1.0)
    for t in (grouped, pooled):
        t.observe(seen, right, [8] * 6)
        t.end_step()
    g, p = grouped.mean([3, 7]).tolist(), pooled.mean([3, 7]).tolist()
    assert g[0] == pytest.approx(0.5) and g[1] < 0.15
    assert p[0] == pytest.approx(p[1]) and 0.2 < p[0] < 0.3
    dead_g = grouped.dead_probability([3, 7], [8, 8]).tolist()
    dead_p = pooled.dead_probability([3, 7], [8, 8]).tolist()
    assert dead_g[0] < 0.1 and dead_g[1] > 0.75
    assert dead_p[0] == pytest.approx(dead_p[1]) and 0.3 < dead_p[0] < 0.5
    assert grouped.mean(seen).tolist() == pytest.approx(grouped.mean()[seen].tolist())
    again = tracker(8, kinds=kinds)
    again.load_state_dict(grouped.state_dict())
    assert again.mean().tolist() == grouped.mean().tolist()
    with pytest.raises(ValueError, match="per-kind"):
        again.load_state_dict(pooled.state_dict())


def test_predict_group_by_names_a_column_of_every_row(tmp_path) -> None:
    tr = world_trainer(tmp_path, allocate=True, allocate_min_group=2, allocate_max_group=8)
    from grpolab.run.collect import kinds_of

    rows = [{"d": "a"}, {"d": "b"}, {"d": "a"}]
    kinds, names = kinds_of(rows, "d")
    assert kinds.tolist() == [0, 1, 0] and names == ["a", "b"] and kinds_of(rows, "") == (None, [])
    with pytest.raises(ConfigError, match="1 of the 3 training rows have no such column"):
        kinds_of([*rows[:2], {}], "d")
    assert tr.tracker.kinds is None
    column = next(k for k, v in tr.train_rows[0].items() if k != "prompt" and isinstance(v, str))
    tr = world_trainer(tmp_path / "by", allocate=True, allocate_min_group=2, allocate_max_group=8,
                       predict_group_by=column)
    assert tr.tracker.kinds is not None and tr.tracker.kind_priors is not None
    rec = tr.step()
    assert rec["answers_generated"] == 32 and math.isfinite(rec["loss"])
    # each kind's prior the step used is logged by its column value (the population's beside)
    values = sorted({str(r[column]) for r in tr.train_rows})
    fitted = [[round(float(x), 4) for x in p] for p in tr.tracker.kind_priors]  # (at step 1's end)
    rec = tr.step()
    assert list(rec["posterior_kind_priors"]) == values and len(values) > 1
    assert [rec["posterior_kind_priors"][v] for v in values] == fitted != [[1.0, 1.0]] * len(fitted)
    assert "posterior_kind_priors" not in world_trainer(tmp_path / "pop", allocate=True).step()
    # per kind: each kind's answers are its quota, step after step
    tr = world_trainer(tmp_path / "quota", allocate=True, allocate_min_group=2,
                       allocate_max_group=8, predict_group_by=column, allocate_by_kind=True)
    kinds = tr.tracker.kinds
    quota = kind_quotas(kinds, 32, 2)
    for _ in range(2):
        idx, sizes = tr.rollouts.choose_prompts(0)
        spent = [sum(n for i, n in zip(idx, sizes) if kinds[i] == k) for k in range(len(quota))]
        assert spent == quota
        tr.step()


def test_alarm_state_is_in_the_trainers_checkpoint(tmp_path, caplog) -> None:
    """A resumed trainer does not warn again at step 2 about the cause it warned of at step 1."""
    tr = world_trainer(tmp_path / "a", reward=never)
    with caplog.at_level(logging.WARNING, logger="grpolab"):
        tr.step()
        assert "NO LEARNING SIGNAL at step 1" in caplog.text
        resumed = world_trainer(tmp_path / "b", reward=never)
        resumed.load_state_dict(tr.state_dict())
        caplog.clear()
        assert resumed.step()["no_signal"] == "all_wrong"
    assert "NO LEARNING SIGNAL" not in caplog.text


def test_refills_by_kind_when_a_kinds_prompts_are_all_had(tmp_path) -> None:
    """allocate_by_kind in a refill round: every prompt of the kinds with a quota had this
    step, one free prompt left of a kind with none: the refill takes any prompt again (it chose
    none: an empty round stopped the run with a bare error)."""
    tr = world_trainer(tmp_path, allocate=True, allocate_by_kind=True, predict_group_by="answer",
                       dynamic_sampling=True, allocate_min_group=2, allocate_max_group=4)
    kinds = tr.tracker.kinds
    quota = kind_quotas(kinds, 32, 2)
    spare = next(i for i in range(len(kinds)) if quota[int(kinds[i])] == 0)
    taken = set(range(len(kinds))) - {spare}
    idx, sizes = tr.rollouts.choose_prompts(0, taken)
    assert idx and sum(sizes) == 32
