"""Advantage formulas on hand-computed values (issue 2 worked example, issue 3 variants)."""

import math

import pytest
import torch

from grpolab.core.advantages import (
    dead_mask,
    dead_stats,
    group_advantages,
    predicted_dead_share,
)


def t(*v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def test_worked_example_population_std() -> None:
    a = group_advantages(t(1, 0, 0, 0), 4)
    # mean 0.25, population std sqrt(0.25 * 0.75) = 0.4330
    assert a[0].item() == pytest.approx(0.75 / math.sqrt(0.1875), abs=1e-6)
    assert a[0].item() == pytest.approx(1.73, abs=5e-3)
    assert a[1:].tolist() == pytest.approx([-0.577] * 3, abs=1e-3)


def test_worked_example_sample_std() -> None:
    a = group_advantages(t(1, 0, 0, 0), 4, std="sample")
    assert a.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-6)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.1, 7.3])
@pytest.mark.parametrize("kw", [{}, {"std": "sample"}, {"scale": "none"}, {"baseline": "rloo"}])
def test_dead_group_is_exactly_zero(value: float, kw: dict) -> None:
    a = group_advantages(t(value, value, value), 3, **kw)
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_scale_free() -> None:
    r = t(1, 0, 1, 1, 0, 0, 0, 1)
    a01 = group_advantages(r, 4)
    a100 = group_advantages(r * 100, 4)
    assert torch.allclose(a01, a100, atol=1e-6)
    assert not torch.allclose(a01, torch.zeros_like(a01))


def test_groups_are_independent() -> None:
    a = group_advantages(t(1, 0, 0, 0, 5, 5, 5, 5, 0, 1, 0, 1), 4)
    assert a[4:8].tolist() == [0.0] * 4
    assert a[8:].tolist() == pytest.approx([-1, 1, -1, 1], abs=1e-6)
    assert a[:4].sum().item() == pytest.approx(0.0, abs=1e-6)


def test_dr_grpo_no_std_division() -> None:
    a = group_advantages(t(1, 0, 0, 0), 4, scale="none")
    assert a.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    # Unlike GRPO, Dr. GRPO advantages keep the reward scale.
    assert group_advantages(t(100, 0, 0, 0), 4, scale="none")[0].item() == pytest.approx(75.0)


def test_rloo_leave_one_out() -> None:
    # r_i - mean of the other three
    a = group_advantages(t(1, 0, 0, 0), 4, baseline="rloo", scale="none")
    assert a.tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # RLOO is G/(G-1) times the mean-baseline advantage.
    r = t(3, 1, 4, 1, 5)
    ratio = group_advantages(r, 5, baseline="rloo", scale="none") / group_advantages(
        r, 5, scale="none"
    )
    assert ratio.tolist() == pytest.approx([1.25] * 5)


def test_tiny_difference_default_and_guard() -> None:
    r = t(1.0, 1.001)
    plain = group_advantages(r, 2)
    # Without a guard a 0.001 reward gap becomes a full unit of advantage.
    assert plain.tolist() == pytest.approx([-1.0, 1.0], abs=1e-3)
    guarded = group_advantages(r, 2, min_std=0.1)
    # std 0.0005 floored to 0.1: (±0.0005)/0.1 = ±0.005
    assert guarded.tolist() == pytest.approx([-0.005, 0.005], abs=1e-4)
    eps = group_advantages(r, 2, std_eps=0.01)
    assert eps.tolist() == pytest.approx([-0.0005 / 0.0105, 0.0005 / 0.0105], abs=1e-4)
    # The guard does not change groups whose std is already large.
    assert group_advantages(t(1, 0), 2, min_std=0.1).tolist() == pytest.approx([1.0, -1.0])


def test_dead_stats_split() -> None:
    r = t(1, 1, 0, 0, 0, 1, 1, 0, 1, 1)
    s = dead_stats(r, 2)
    assert (s.groups, s.dead, s.all_right, s.all_wrong) == (5, 3, 2, 1)
    assert s.dead_share == pytest.approx(0.6)
    assert dead_mask(r, 2).tolist() == [True, True, False, False, True]


def test_dead_stats_split_by_verdict_not_total() -> None:
    """Totals of [verifier, format]: 1.5 right and formatted, 1.0 formatted but wrong (or right
    and unformatted), 0 neither. The verdicts decide all right vs all wrong, not the totals."""
    total = t(1.5, 1.5, 1.0, 1.0, 0.0, 0.0, 1.5, 1.0)
    right = torch.tensor([True, True, False, False, False, False, True, False])
    s = dead_stats(total, 2, right)
    assert (s.groups, s.dead, s.all_right, s.all_wrong) == (4, 3, 1, 2)
    assert dead_stats(total, 2).all_right == 2  # by total >= 1, the formatted wrong pair too


def test_predicted_dead_share() -> None:
    # p = 0.5, G = 2: dead when both right (1/4) or both wrong (1/4)
    assert predicted_dead_share(t(0.5), 2) == pytest.approx(0.5)
    # p in {0, 1} always dead; p = 0.5 at G = 8: 2 / 256
    assert predicted_dead_share(t(0.0, 1.0, 0.5), 8) == pytest.approx((1 + 1 + 2 / 256) / 3)
    # Larger groups never die more often.
    p = torch.rand(100, generator=torch.Generator().manual_seed(0))
    shares = [predicted_dead_share(p, g) for g in (2, 4, 8, 16, 32)]
    assert shares == sorted(shares, reverse=True)


def test_bad_shape() -> None:
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(t(1, 0, 0), 4)
