"""The pass-rate prior fitted to decayed counts, against the population it was drawn from.

A simulated run: N prompts whose true pass rates are 0 (a share), 1 (a share) or uniform in
between; each step samples ``--per`` prompts x G answers, observes them and refits the prior
(decay 0.97, as the trainer). Printed per prior: its mean mass at rate 0 and 1 at the end
(truth: --zero, --one), the predicted and measured dead share of the groups after warm-up, and
the Brier score of "this group will be dead". ``grid-raw`` is the grid prior fitted to the
decayed counts as they are (before 2026-12-07), ``grid`` to each prompt's effective number of
answers. Usage: python bench/prior_fit.py [--seeds 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from grpolab.predict import posterior as P


def run(kind: str, seed: int, a: argparse.Namespace) -> tuple[float, ...]:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(a.prompts, generator=g)
    mid = torch.rand(a.prompts, generator=g)
    rates = torch.where(u < a.zero, 0.0, torch.where(u < a.zero + a.one, 1.0, mid))
    tr = (P.PassRateTracker if kind == "beta" else P.GridPassRateTracker)(a.prompts, 0.97)
    fit = P.fit_grid_prior
    if kind == "grid-raw":  # (the decayed counts read as answers)
        P.fit_grid_prior = lambda s, f, grid, init, iters=100, squares=None: fit(s, f, grid, init)
    pred, dead = [], []
    try:
        for t in range(a.steps):
            idx = torch.randperm(a.prompts, generator=g)[: a.per]
            p = tr.dead_probability(idx, a.group)
            right = torch.binomial(torch.full((a.per,), float(a.group)), rates[idx], generator=g)
            if t >= a.warmup:
                pred.append(p)
                dead.append(((right == 0) | (right == a.group)).double())
            tr.observe(idx, right, [a.group] * a.per)
            tr.end_step()
    finally:
        P.fit_grid_prior = fit
    p, d = torch.cat(pred), torch.cat(dead)
    if kind == "beta":  # (mass near 0 and 1: the Beta's within half a grid step)
        a0, b0 = tr.prior
        beta = torch.distributions.Beta(torch.tensor(a0), torch.tensor(b0))
        x = torch.linspace(1e-4, 0.025, 200)
        w0 = float(beta.log_prob(x).exp().mean() * 0.025)
        w1 = float(beta.log_prob(1 - x).exp().mean() * 0.025)
    else:
        w0, w1 = float(tr.weights[0]), float(tr.weights[-1])
    return w0, w1, float(p.mean()), float(d.mean()), float(((p - d) ** 2).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--per", type=int, default=16, help="prompts a step")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--zero", type=float, default=0.35, help="share of prompts never solved")
    ap.add_argument("--one", type=float, default=0.20, help="share always solved")
    a = ap.parse_args()
    print(f"truth: mass at 0 {a.zero:.3f}, at 1 {a.one:.3f}; {a.seeds} seeds")
    print("| prior | mass at 0 | mass at 1 | predicted dead | measured dead | Brier |")
    print("|---|---|---|---|---|---|")
    brier = {}
    for kind in ("grid-raw", "grid", "beta"):
        rows = [run(kind, s, a) for s in range(a.seeds)]
        brier[kind] = [r[4] for r in rows]
        cols = []
        for i in range(5):
            xs = [r[i] for r in rows]
            se = statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else 0.0
            cols.append(f"{statistics.mean(xs):.4f} ± {se:.4f}")
        print(f"| {kind} | " + " | ".join(cols) + " |")
    d = [x - y for x, y in zip(brier["grid"], brier["grid-raw"])]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else 0.0
    print(f"Brier, grid - grid-raw (same seeds): {statistics.mean(d):+.4f} ± {se:.4f}")


if __name__ == "__main__":
    main()
