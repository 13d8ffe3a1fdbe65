"""Per-prompt pass-rate posteriors: predict which groups will be dead before sampling them.

Works for any backend: each prompt's answers so far (right / wrong, by ``success_threshold``)
give it a Beta posterior over its pass rate p,

    p_i ~ Beta(a0 + s_i, b0 + f_i)

where s_i, f_i are its right and wrong answers, each multiplied by ``decay`` once per step since
it was seen (old evidence fades as the policy changes), and Beta(a0, b0) is a prior fitted to
every prompt seen so far by the method of moments of the beta-binomial (``fit_beta_prior``), so a
prompt never seen is predicted from the population. A group of n answers is dead when all are
right or all wrong; under the posterior

    P(dead) = E[p^n + (1-p)^n] = B(a+n, b) / B(a, b) + B(a, b+n) / B(a, b)

in closed form (``dead_probability``). The predicted dead share of a step is the mean of this
over its groups; ``brier_score`` and ``reliability_table`` say how good the prediction was, and
``calibration_summary`` (and ``run.plots.plot_calibration``) turn a run's metrics into the summary's numbers
and ``calibration.png``.

With ``kinds`` (config ``predict_group_by``: a column such as a difficulty), each kind of
prompt gets its own fitted Beta: a prompt never seen is predicted from the prompts of its kind.

``GridPassRateTracker`` keeps the same counts under another prior: a discrete distribution over
a grid of pass rates fitted by EM (the nonparametric maximum-likelihood prior of the binomial
counts), which can hold several bands at once (prompts always solved, never solved, and some
between), where one Beta cannot. ``PASS_RATE_PRIORS`` names both (config ``predict_prior``).

All maths is float64 tensor arithmetic on shapes given in each docstring.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

DEFAULT_PRIOR = (1.0, 1.0)  # before any answer is seen: uniform pass rate
MIN_STRENGTH, MAX_STRENGTH = 0.2, 200.0  # range of the fitted prior's a0 + b0
RELIABILITY_BINS = 10


def log_beta(a: Tensor, b: Tensor) -> Tensor:
    """log B(a, b) = lgamma(a) + lgamma(b) - lgamma(a + b), elementwise (broadcasts)."""
    return torch.lgamma(a) + torch.lgamma(b) - torch.lgamma(a + b)


def dead_probability(a: Tensor, b: Tensor, n: Tensor | int) -> Tensor:
    """E[p^n + (1-p)^n] under p ~ Beta(a, b): the chance that a group of n answers is dead.

    ``a``, ``b`` [K] (> 0), ``n`` an int or [K] group sizes (>= 1) -> [K] float64.
    E[p^n] = B(a+n, b) / B(a, b) (the Beta's n-th raw moment); E[(1-p)^n] likewise with b.
    """
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    lb = log_beta(a, b)
    return (torch.exp(log_beta(a + n, b) - lb) + torch.exp(log_beta(a, b + n) - lb)).clamp(0, 1)


def fit_beta_prior(successes: Tensor, failures: Tensor, strength: float = 0.0,
                   default: tuple[float, float] = DEFAULT_PRIOR,
                   squares: Tensor | None = None) -> tuple[float, float]:
    """Beta(a0, b0) of the prompts' pass rates, by the method of moments of the beta-binomial.

    ``successes``, ``failures`` [N] (decayed, so fractional) counts per prompt; ``squares`` [N]
    each prompt's sum of its answers' squared weights (an answer weighs decay^age; None: every
    weight 1, undecayed counts). Prompts with under one answer's worth of evidence are left
    out. The mean is m = sum s / sum n; the spread comes from the n-weighted scatter of the
    prompts' rates r_i = s_i / n_i: with rho = 1 / (a0 + b0 + 1) and q_i the squares,
    E[sum_i n_i (r_i - m)^2] = m (1-m) (rho N + (1 - rho) Q) for N = sum n_i answers and
    Q = sum q_i / n_i (K, the prompts, when every weight is 1), solved for rho. ``strength``
    > 0 fixes a0 + b0 instead (only the mean is fitted). a0 + b0 is kept in [MIN_STRENGTH,
    MAX_STRENGTH]; with under two prompts (or no prompt seen twice when the spread is
    needed) ``default`` is returned.
    """
    s = successes.to(torch.float64)
    n = s + failures.to(torch.float64)
    keep = n >= 1.0
    s, n = s[keep], n[keep]
    k, total = int(n.numel()), float(n.sum())
    if k < 2:
        return default
    half = 0.5 / (total + 1.0)  # never exactly 0 or 1: a0, b0 stay > 0
    m = min(max(float(s.sum()) / total, half), 1.0 - half)
    if strength > 0:
        c = strength
    else:
        q = float(k) if squares is None else float((squares.to(torch.float64)[keep] / n).sum())
        if total - q < 1e-9:
            return default
        scatter = float((n * (s / n - m) ** 2).sum()) / (m * (1 - m))
        rho = (scatter - q) / (total - q)
        rho = min(max(rho, 1.0 / (MAX_STRENGTH + 1)), 1.0 / (MIN_STRENGTH + 1))
        c = 1.0 / rho - 1.0
    return m * c, (1.0 - m) * c


class PassRateTracker:
    """Decayed right/wrong counts per prompt and the fitted prior: Beta posteriors on demand.

    Use per step: ``dead_probability(idx, sizes)`` for the groups about to be scored (before
    their outcome is seen), ``observe(idx, successes, sizes)`` once scored, ``end_step()`` after
    the step (decays every count by ``decay`` and refits the prior).
    """

    def __init__(self, n: int, decay: float = 0.97, prior_strength: float = 0.0,
                 kinds: Tensor | None = None) -> None:
        self.n = n
        self.decay = decay
        self.prior_strength = prior_strength
        self.successes = torch.zeros(n, dtype=torch.float64)
        self.failures = torch.zeros(n, dtype=torch.float64)
        self.squares = torch.zeros(n, dtype=torch.float64)  # sum of squared answer weights
        self.prior = DEFAULT_PRIOR
        # kinds [N]: prompts of one kind (e.g. one difficulty) share a prior fitted to them
        # alone, the population's while fewer than two of them were seen; [K, 2] (a0, b0)
        self.kinds = kinds
        self.kind_priors = (None if kinds is None else
                            torch.tensor([DEFAULT_PRIOR], dtype=torch.float64)
                            .repeat(int(kinds.max()) + 1, 1))

    def posterior(self, idx: list[int] | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(a, b) [K] of the prompts ``idx`` (every prompt when None)."""
        s, f = self.successes, self.failures
        t = None if idx is None else torch.as_tensor(idx, dtype=torch.long)
        if t is not None:
            s, f = s[t], f[t]
        if self.kind_priors is not None:
            pk = self.kind_priors[self.kinds if t is None else self.kinds[t]]
            return pk[:, 0] + s, pk[:, 1] + f
        return self.prior[0] + s, self.prior[1] + f

    def mean(self, idx: list[int] | Tensor | None = None) -> Tensor:
        """Posterior mean pass rate [K]."""
        a, b = self.posterior(idx)
        return a / (a + b)

    def dead_probability(self, idx: list[int] | Tensor, sizes: list[int] | Tensor | int) -> Tensor:
        """[K] P(a group of sizes[k] answers to prompt idx[k] is dead) under the posterior."""
        a, b = self.posterior(idx)
        return dead_probability(a, b, torch.as_tensor(sizes, dtype=torch.float64))

    def dead_table(self, sizes: Tensor) -> Tensor:
        """[N, S] P(dead) of a group of each of ``sizes`` [S] answers, for every prompt."""
        a, b = self.posterior()
        return dead_probability(a[:, None], b[:, None], torch.as_tensor(sizes)[None, :])

    def prior_summary(self, kind: int | None = None) -> list[float]:
        """The fitted prior (of ``kind``, where priors are per kind), for the metrics line:
        [a0, b0]."""
        prior = self.prior if kind is None else self.kind_priors[kind].tolist()
        return [round(float(x), 4) for x in prior]

    def observe(self, idx: list[int] | Tensor, successes: Tensor, sizes: Tensor | list[int]) -> None:
        """Add each group's right answers ``successes`` [K] out of ``sizes`` [K] to its prompt
        (a prompt may appear twice: both groups count)."""
        t = torch.as_tensor(idx, dtype=torch.long)
        s = torch.as_tensor(successes, dtype=torch.float64)
        n = torch.as_tensor(sizes, dtype=torch.float64)
        self.successes.index_add_(0, t, s)
        self.failures.index_add_(0, t, n - s)
        self.squares.index_add_(0, t, n)  # (each new answer weighs 1)

    def end_step(self) -> None:
        """Fade all evidence by ``decay`` and refit the prior to what is left."""
        self.successes.mul_(self.decay)
        self.failures.mul_(self.decay)
        self.squares.mul_(self.decay ** 2)
        self.prior = fit_beta_prior(self.successes, self.failures, self.prior_strength,
                                    squares=self.squares)
        if self.kinds is not None and self.kind_priors is not None:
            for k in range(len(self.kind_priors)):
                mine = self.kinds == k
                self.kind_priors[k] = torch.tensor(fit_beta_prior(
                    self.successes[mine], self.failures[mine], self.prior_strength, self.prior,
                    self.squares[mine]))

    def state_dict(self) -> dict[str, Any]:
        st = {"successes": self.successes.clone(), "failures": self.failures.clone(),
              "squares": self.squares.clone(), "prior": list(self.prior)}
        if self.kind_priors is not None:
            st["kind_priors"] = self.kind_priors.clone()
        return st

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.successes.copy_(st["successes"])
        self.failures.copy_(st["failures"])  # (a checkpoint before squares were kept: as if
        self.squares.copy_(st.get("squares", self.successes + self.failures))  # undecayed)
        self.prior = (float(st["prior"][0]), float(st["prior"][1]))
        if self.kind_priors is not None:
            if "kind_priors" not in st:
                raise ValueError("the checkpoint's pass-rate posteriors have no per-kind priors "
                                 "(saved without predict_group_by)")
            self.kind_priors.copy_(st["kind_priors"])


GRID_POINTS = 21  # pass rates 0, 0.05, ..., 1 of the grid prior
GRID_PSEUDO = 0.05  # prompts' worth of evidence given to each grid point (no rate ruled out)


def fit_grid_prior(successes: Tensor, failures: Tensor, grid: Tensor, init: Tensor,
                   iters: int = 100, squares: Tensor | None = None) -> Tensor:
    """Weights [J] of a discrete prior on the pass rates ``grid`` [J], by EM on the binomial
    counts ``successes``, ``failures`` [N] (decayed, so fractional; prompts with under one
    answer's worth are left out), started from ``init`` [J].

    E step: prompt i's posterior over the grid, w_ij ~ pi_j p_j^s_i (1 - p_j)^f_i; M step:
    pi_j = (sum_i w_ij + c) / (K + c J), with c = ``GRID_PSEUDO``. ``init`` comes back when
    under two prompts have evidence. ``squares`` [N] (the squared answer weights' sums): each
    prompt's counts are scaled to its effective number of answers n^2 / squares, as decayed
    counts read as fewer answers make each rate look noisier than it is and the fitted prior
    too narrow (its mass at 0 and 1 too small).
    """
    s = successes.to(torch.float64)
    f = failures.to(torch.float64)
    if squares is not None:
        n = s + f
        scale = torch.where(squares > 0, n / squares.to(torch.float64).clamp_min(1e-300), 1.0)
        s, f = s * scale, f * scale
    keep = s + f >= 1.0
    s, f = s[keep], f[keep]
    if s.numel() < 2:
        return init
    loglik = _grid_loglik(s, f, grid)  # [K, J]
    pi = init.clone()
    for _ in range(iters):
        post = torch.softmax(loglik + pi.log()[None, :], dim=1)
        pi = (post.sum(0) + GRID_PSEUDO) / (s.numel() + GRID_PSEUDO * grid.numel())
    return pi


def _grid_loglik(s: Tensor, f: Tensor, grid: Tensor) -> Tensor:
    """log p_j^s (1 - p_j)^f [K, J] (0 log 0 = 0: a rate of 0 or 1 fits counts it allows)."""
    return torch.xlogy(s[:, None], grid[None, :]) + torch.xlogy(f[:, None], 1 - grid[None, :])


class GridPassRateTracker(PassRateTracker):
    """``PassRateTracker`` whose prior is a grid of pass rates with fitted weights
    (``fit_grid_prior``) instead of one Beta: each prompt's posterior is a weight per grid rate.
    """

    def __init__(self, n: int, decay: float = 0.97, prior_strength: float = 0.0,
                 kinds: Tensor | None = None) -> None:
        super().__init__(n, decay, prior_strength, kinds)
        self.grid = torch.linspace(0.0, 1.0, GRID_POINTS, dtype=torch.float64)
        self.weights = torch.full((GRID_POINTS,), 1.0 / GRID_POINTS, dtype=torch.float64)
        self.kind_priors = (None if kinds is None else  # [K, J] each kind's grid weights
                            self.weights.repeat(int(kinds.max()) + 1, 1))

    def grid_posterior(self, idx: list[int] | Tensor | None = None) -> Tensor:
        """[K, J] each prompt's posterior weight on each grid rate."""
        s, f = self.successes, self.failures
        t = None if idx is None else torch.as_tensor(idx, dtype=torch.long)
        if t is not None:
            s, f = s[t], f[t]
        if self.kind_priors is not None:
            logw = self.kind_priors[self.kinds if t is None else self.kinds[t]].log()
            return torch.softmax(_grid_loglik(s, f, self.grid) + logw, dim=1)
        return torch.softmax(_grid_loglik(s, f, self.grid) + self.weights.log()[None, :], dim=1)

    def _dead_by_size(self, sizes: Tensor) -> Tensor:
        """[J, S] p_j^n + (1 - p_j)^n for each grid rate and size."""
        n = torch.as_tensor(sizes, dtype=torch.float64)[None, :]
        g = self.grid[:, None]
        return g.pow(n) + (1 - g).pow(n)

    def mean(self, idx: list[int] | Tensor | None = None) -> Tensor:
        return self.grid_posterior(idx) @ self.grid

    def dead_probability(self, idx: list[int] | Tensor, sizes: list[int] | Tensor | int) -> Tensor:
        w = self.grid_posterior(idx)  # [K, J]
        n = torch.as_tensor(sizes, dtype=torch.float64).expand(w.shape[0])
        return (w * self._dead_by_size(n).T).sum(1).clamp(0, 1)

    def dead_table(self, sizes: Tensor) -> Tensor:
        return (self.grid_posterior() @ self._dead_by_size(sizes)).clamp(0, 1)

    def prior_summary(self, kind: int | None = None) -> list[float]:
        """The fitted prior (of ``kind``), for the metrics line: [mean rate, weight at 0,
        weight at 1]."""
        w = self.weights if kind is None else self.kind_priors[kind]
        return [round(float(w @ self.grid), 4), round(float(w[0]), 4), round(float(w[-1]), 4)]

    def end_step(self) -> None:
        self.successes.mul_(self.decay)
        self.failures.mul_(self.decay)
        self.squares.mul_(self.decay ** 2)
        self.weights = fit_grid_prior(self.successes, self.failures, self.grid, self.weights,
                                      squares=self.squares)
        if self.kinds is not None and self.kind_priors is not None:
            for k in range(len(self.kind_priors)):
                mine = self.kinds == k
                enough = int((self.successes[mine] + self.failures[mine] >= 1.0).sum()) >= 2
                self.kind_priors[k] = fit_grid_prior(
                    self.successes[mine], self.failures[mine], self.grid,
                    self.kind_priors[k] if enough else self.weights, squares=self.squares[mine])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "grid_weights": self.weights.clone()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        super().load_state_dict(st)
        if "grid_weights" in st:
            self.weights = st["grid_weights"].to(torch.float64).clone()


# config predict_prior -> the tracker that keeps the posteriors
PASS_RATE_PRIORS: dict[str, type[PassRateTracker]] = {
    "beta": PassRateTracker,
    "grid": GridPassRateTracker,
}


# ------------------------------------------------------------------ calibration --


def brier_score(predicted: Tensor, outcome: Tensor) -> float:
    """Mean squared error of probabilities ``predicted`` [K] against 0/1 ``outcome`` [K]."""
    p = torch.as_tensor(predicted, dtype=torch.float64)
    y = torch.as_tensor(outcome, dtype=torch.float64)
    return float(((p - y) ** 2).mean()) if p.numel() else float("nan")


def reliability_table(predicted: Tensor, outcome: Tensor,
                      bins: int = RELIABILITY_BINS) -> list[dict[str, float]]:
    """Groups binned by predicted P(dead) in ``bins`` equal-width bins of [0, 1] (the last one
    closed); per non-empty bin: its range, number of groups, mean prediction and the measured
    dead share. A calibrated predictor has mean_predicted close to measured in every bin."""
    p = torch.as_tensor(predicted, dtype=torch.float64)
    y = torch.as_tensor(outcome, dtype=torch.float64)
    which = torch.clamp((p * bins).long(), max=bins - 1)
    out = []
    for i in range(bins):
        sel = which == i
        k = int(sel.sum())
        if k:
            out.append({"lo": i / bins, "hi": (i + 1) / bins, "groups": k,
                        "mean_predicted": float(p[sel].mean()), "measured": float(y[sel].mean())})
    return out


def _pairs(rows: list[dict]) -> tuple[Tensor, Tensor]:
    pred: list[float] = []
    dead: list[float] = []
    for r in rows:
        if r.get("group_dead_prob") is not None and r.get("group_dead") is not None:
            pred += r["group_dead_prob"]
            dead += r["group_dead"]
    return torch.tensor(pred, dtype=torch.float64), torch.tensor(dead, dtype=torch.float64)


def calibration_summary(rows: list[dict]) -> dict[str, Any]:
    """From a run's metrics lines: the posterior's Brier score for "this group will be dead",
    the Brier score of always predicting the run's dead share (a predictor is informative when
    it beats it), the mean predicted and measured dead share over the same groups (pooled:
    a step of more groups counts more, unlike the summary's per-step mean_dead_share), and
    the reliability table. Empty when no line carries the per-group predictions."""
    pred, dead = _pairs(rows)
    if not pred.numel():
        return {}
    base = float(dead.mean())
    return {
        "posterior_dead_groups": int(pred.numel()),
        "mean_posterior_dead_share": float(pred.mean()),
        "posterior_measured_dead_share": base,
        "posterior_dead_brier": brier_score(pred, dead),
        "posterior_dead_brier_base_rate": brier_score(torch.full_like(dead, base), dead),
        "posterior_dead_reliability": reliability_table(pred, dead),
    }
