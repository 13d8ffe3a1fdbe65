"""A batch of sampled answers (``Rollout``) and what is done to one: joining, cutting into
mini-batches and micro-batches, the mask up to the first EOS, position ids, prompts shared by
a group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Rollout:
    """A batch of sampled answers, row i answering ``prompts[i]``."""

    prompts: list[Any]
    prompt_ids: Tensor  # [B, Tp], left-padded where prompts differ in length
    prompt_mask: Tensor  # [B, Tp] 1 on real prompt tokens
    completion_ids: Tensor  # [B, Tc], PAD after the end
    completion_mask: Tensor  # [B, Tc] 1 on answer tokens, EOS included
    completions: list[str]
    truncated: Tensor | None = None  # [B] bool: cut off at max_new_tokens, no EOS (if known)

    def answer_ids(self) -> list[list[int]]:
        """Each answer's token ids, its EOS included (TRL's ``completion_ids``)."""
        return [row[m.bool()].tolist() for row, m in zip(self.completion_ids,
                                                          self.completion_mask)]

    def select(self, idx: list[int]) -> Rollout:
        t = torch.as_tensor(idx, dtype=torch.long)
        return Rollout(
            prompts=[self.prompts[i] for i in idx],
            prompt_ids=self.prompt_ids[t],
            prompt_mask=self.prompt_mask[t],
            completion_ids=self.completion_ids[t],
            completion_mask=self.completion_mask[t],
            completions=[self.completions[i] for i in idx],
            truncated=None if self.truncated is None else self.truncated[t],
        )


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Join rollouts whose prompt/completion widths may differ (left-pad prompts, right-pad answers)."""
    tp = max(r.prompt_ids.shape[1] for r in parts)
    tc = max(r.completion_ids.shape[1] for r in parts)

    def lpad(x: Tensor, w: int, v: int) -> Tensor:
        return torch.nn.functional.pad(x, (w - x.shape[1], 0), value=v)

    def rpad(x: Tensor, w: int, v: int) -> Tensor:
        return torch.nn.functional.pad(x, (0, w - x.shape[1]), value=v)

    return Rollout(
        prompts=[p for r in parts for p in r.prompts],
        prompt_ids=torch.cat([lpad(r.prompt_ids, tp, pad_id) for r in parts]),
        prompt_mask=torch.cat([lpad(r.prompt_mask, tp, 0) for r in parts]),
        completion_ids=torch.cat([rpad(r.completion_ids, tc, pad_id) for r in parts]),
        completion_mask=torch.cat([rpad(r.completion_mask, tc, 0) for r in parts]),
        completions=[c for r in parts for c in r.completions],
        truncated=(None if any(r.truncated is None for r in parts)
                   else torch.cat([r.truncated for r in parts])),
    )


def micro_batches(ro: Rollout, adv: Tensor, size: int) -> list[tuple[Rollout, Tensor]]:
    """``ro`` and its advantages in runs of ``size`` rows (all at once when 0), each cut to its
    longest answer: an update's memory is bounded by one of them."""
    n = len(ro.prompts)
    if not size or size >= n:
        return [(ro, adv)]
    return [(cut_to_longest(ro.select(list(range(lo, min(lo + size, n))))), adv[lo : lo + size])
            for lo in range(0, n, size)]


def cut_to_longest(ro: Rollout) -> Rollout:
    """``ro`` with its answers' padding cut to the longest answer, in place (a part of a batch
    then costs what its own answers cost)."""
    width = max(int(ro.completion_mask.sum(1).max()), 1)
    ro.completion_ids, ro.completion_mask = ro.completion_ids[:, :width], ro.completion_mask[:, :width]
    return ro


def minibatch_rows(sizes: list[int], m: int, generator: torch.Generator | None = None
                   ) -> list[Tensor]:
    """The rows (ascending indices) of each of ``m`` mini-batches of a batch whose groups hold
    ``sizes`` answers, in order: whole groups, contiguous, cut at the group boundaries nearest
    equal shares of the answers (verl's split); with ``generator``, the answers shuffled and
    dealt out in ``m`` runs of near-equal length (TRL's ``steps_per_generation`` buffer). A
    mini-batch may be empty when there are fewer groups (or answers) than ``m``."""
    n = sum(sizes)
    if generator is not None:
        perm = torch.randperm(n, generator=generator)
        cut = [n * k // m for k in range(m + 1)]
        return [perm[cut[k]:cut[k + 1]].sort().values for k in range(m)]
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    cuts = [0]
    for k in range(1, m):
        ahead = [b for b in bounds if b >= cuts[-1]]
        cuts.append(min(ahead, key=lambda b: (abs(b - n * k / m), b)))
    cuts.append(n)
    return [torch.arange(cuts[k], cuts[k + 1]) for k in range(m)]


def first_eos_mask(ids: Tensor, eos_ids: list[int],
                   pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mask completion tokens up to and including the first EOS (any of ``eos_ids``).

    Returns the ids with PAD after the first EOS and the 0/1 mask, both [B, Tc], and which rows
    have no EOS at all [B] (cut off by the length limit).
    """
    is_eos = torch.isin(ids, torch.as_tensor(eos_ids, dtype=ids.dtype, device=ids.device))
    after = (is_eos.long().cumsum(dim=1) - is_eos.long()) > 0  # strictly after the first EOS
    return ids.masked_fill(after, pad_id), (~after).long(), ~is_eos.any(dim=1)


def pos_ids(mask: Tensor) -> Tensor:
    """Position ids that count only real tokens (left padding gets 0), as ``generate`` uses."""
    return (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 0)


def shared_prompts(ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(unique prompt ids, their mask, row -> unique index) when some rows repeat, else None."""
    key = torch.cat([ids, mask], dim=1)
    uniq, inv = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == ids.shape[0]:
        return None
    return uniq[:, : ids.shape[1]], uniq[:, ids.shape[1]:], inv
