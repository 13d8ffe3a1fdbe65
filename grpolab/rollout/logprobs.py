"""The scoring pass's forwards: each distinct prompt prefilled once for the rows that share it
(``shared_prefix_logits``), and answers of unequal length scored in length buckets, real
positions only (``length_buckets``, ``bucketed_hidden``)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grpolab.rollout.batch import Rollout, pos_ids, shared_prompts
from grpolab.rollout.sampling import Forward


def shared_prefix_logits(lm: Forward, ids: Tensor, attn: Tensor, pos: Tensor, tc: int,
                         shared: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """Logits [B, tc, V] predicting the last tc tokens of ``ids``, each distinct prompt run once.

    ``shared`` = (distinct prompt ids, their mask, row -> distinct index). The prompts' keys and
    values (with their autograd history) go to the rows that share them, so the G answers of a
    group attend to, and backpropagate into, one prompt pass: the maths of the one-pass
    forward, (G - 1) / G less prompt compute.
    """
    u_ids, u_mask, inv = shared
    tp = ids.shape[1] - tc
    first, state = lm.prefill(u_ids, u_mask)  # the last prompt position predicts token 0
    first = first[inv]
    if tc == 1:
        return first
    rest = lm.extend(state, inv, ids[:, tp:-1], attn, pos[:, tp:-1])
    return torch.cat([first, rest], dim=1)


def completion_logits(lm: Forward, ro: Rollout, device: torch.device,
                      share_prompts: bool = True) -> Tensor:
    """Logits [B, Tc, V] predicting every completion token of ``ro``: one forward over
    [left-padded prompt | completion] with position ids counting real tokens only (as sampling
    does), or with ``share_prompts`` each distinct prompt run once."""
    tc = ro.completion_ids.shape[1]
    ids, attn, pos, shared = _scoring_inputs(ro, device, share_prompts)
    if shared is not None:
        return shared_prefix_logits(lm, ids, attn, pos, tc, shared)
    return lm.logits(ids[:, :-1], attn[:, :-1], pos[:, :-1], keep=tc)


def _scoring_inputs(ro: Rollout, device: torch.device, share_prompts: bool
                    ) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor] | None]:
    """[prompt | completion] ids, attention mask and position ids (counting real tokens only,
    as sampling does) on ``device``, and ``shared_prompts`` of the prompts (with
    ``share_prompts``, else None)."""
    ids = torch.cat([ro.prompt_ids, ro.completion_ids], dim=1)
    attn = torch.cat([ro.prompt_mask, torch.ones_like(ro.completion_ids)], dim=1)
    pos = pos_ids(attn)
    shared = shared_prompts(ro.prompt_ids, ro.prompt_mask) if share_prompts else None
    if shared is not None:
        shared = tuple(x.to(device) for x in shared)
    return ids.to(device), attn.to(device), pos.to(device), shared


# Answers of unequal length are scored in a few forwards, each cut to its longest answer; each
# forward costs about this many answer positions on top of its own (per-op overhead; measured
# on a 2-core CPU). On accelerators a forward's launch overhead is worth far more positions:
# BUCKET_COST_ACCEL there, a guess (no GPU measurement yet).
BUCKET_COST = 16


BUCKET_COST_ACCEL = 256



def answer_lengths(mask: Tensor) -> list[int]:
    """Each row's scored length: up to its last real position (0 for a row with none)."""
    tc = mask.shape[1]
    last = torch.arange(1, tc + 1).mul(mask.cpu().bool()).amax(dim=1)
    return [int(x) for x in last]


def length_buckets(lengths: list[int], cost: float | None = None) -> list[list[int]]:
    """Rows with answers (length > 0) in buckets of similar length, longest first: the split of
    the rows sorted by length that minimises the positions scored, sum of (rows x longest +
    ``cost``, default ``BUCKET_COST``) over buckets (exact, by dynamic programming over the
    sorted rows)."""
    cost = BUCKET_COST if cost is None else cost
    order = sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: -lengths[r])
    ln = [lengths[r] for r in order]
    n = len(ln)
    best, cut = [0.0] + [math.inf] * n, [0] * (n + 1)
    for i in range(1, n + 1):  # best[i]: the first i rows; a bucket j..i-1 is l[j] long
        for j in range(i):
            c = best[j] + (i - j) * ln[j] + cost
            if c < best[i]:
                best[i], cut[i] = c, j
    out, i = [], n
    while i:
        out.append(order[cut[i]:i])
        i = cut[i]
    return out[::-1]


def bucketed_hidden(lm: Forward, ro: Rollout, device: torch.device, share: bool,
                    buckets: list[list[int]], lengths: list[int]) -> tuple[Tensor, Tensor]:
    """``completion_logits`` of ``lm`` (a trunk: hidden states) at the real answer positions
    only, bucket by bucket: ([N, D] for the N positions where ``ro.completion_mask`` is 1, their
    flat indices row * Tc + column [N]). The prompts are run once for all buckets when shared.
    """
    ids, attn, pos, shared = _scoring_inputs(ro, device, share)
    tp = ro.prompt_ids.shape[1]
    if shared is not None:
        u_ids, u_mask, inv = shared
        first, state = lm.prefill(u_ids, u_mask)
    mask = ro.completion_mask.to(device).bool()
    flat = torch.arange(mask.numel(), device=device).view_as(mask)
    hs, where = [], []
    for rows in buckets:
        n = lengths[rows[0]]
        r = torch.tensor(rows, device=device)
        if shared is not None:
            h = first[inv[r]]
            if n > 1:
                rest = lm.extend(state, inv[r], ids[r, tp:tp + n - 1], attn[r, :tp + n],
                                 pos[r, tp:tp + n - 1])
                h = torch.cat([h, rest], dim=1)
        else:
            h = lm.logits(ids[r, :tp + n - 1], attn[r, :tp + n - 1], pos[r, :tp + n - 1], keep=n)
        m = mask[r, :n]
        hs.append(h[m])
        where.append(flat[r, :n][m])
    return torch.cat(hs), torch.cat(where)
