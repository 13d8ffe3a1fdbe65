"""Which prompts to train on: uniform draws, passes over the data, or a curriculum from
per-prompt running pass rates.

``order`` "random" draws each step's prompts afresh (distinct within a step); "epochs" takes
them from a shuffled pass over the data, each prompt once a pass (TRL's sampler with
shuffle_dataset); "sequential" from passes in the data's order (shuffle_dataset false).
A group is only useful when the policy sometimes fails the prompt; the curriculum (random
order only) keeps an exponential moving average of each prompt's group pass rate and draws
prompts with weight max(floor, 4 p (1 - p)), so prompts it always or never solves fade out
but are never dropped.
"""

from __future__ import annotations

import torch
from torch import Tensor


def curriculum_weights(pass_rate: Tensor, seen: Tensor, floor: float, unseen: float) -> Tensor:
    """Sampling weight per prompt: 4p(1-p) (1 at p=1/2), at least ``floor``; ``unseen`` if new."""
    w = torch.clamp(4 * pass_rate * (1 - pass_rate), min=floor)
    return torch.where(seen, w, torch.full_like(w, unseen))


class PromptSampler:
    """Draws prompt indices for a step and keeps per-prompt running statistics."""

    def __init__(
        self,
        n: int,
        generator: torch.Generator,
        curriculum: bool = False,
        floor: float = 0.05,
        decay: float = 0.5,
        unseen: float = 0.5,
        order: str = "random",
    ) -> None:
        if curriculum and order != "random":
            raise ValueError("the curriculum draws by weight: order must be random")
        self.n = n
        self.generator = generator
        self.curriculum, self.order = curriculum, order
        self.floor, self.decay, self.unseen = floor, decay, unseen
        self.pass_rate = torch.zeros(n, dtype=torch.float64)
        self.visits = torch.zeros(n, dtype=torch.long)
        self.queue = torch.zeros(0, dtype=torch.long)  # the current pass's prompts still to come

    def weights(self) -> Tensor:
        if not self.curriculum:
            return torch.ones(self.n, dtype=torch.float64)
        return curriculum_weights(self.pass_rate, self.visits > 0, self.floor, self.unseen)

    def draw(self, k: int, exclude: set[int] | None = None) -> list[int]:
        """k distinct prompts (without replacement within a draw)."""
        if self.order != "random":
            return self._from_passes(min(k, self.n))
        w = self.weights().clone()
        if exclude:
            w[list(exclude)] = 0.0
        k = min(k, int((w > 0).sum()))
        return torch.multinomial(w, k, replacement=False, generator=self.generator).tolist()

    def _from_passes(self, k: int) -> list[int]:
        """The next k prompts of the passes; where a pass ends the next begins, skipping the
        prompts this draw already holds (they keep their place in the new pass)."""
        if len(self.queue) >= k:  # within the pass: its next k
            out, self.queue = self.queue[:k].tolist(), self.queue[k:]
            return out
        out = []
        while len(out) < k:
            if not len(self.queue):
                self.queue = (torch.randperm(self.n, generator=self.generator)
                              if self.order == "epochs" else torch.arange(self.n))
            taken = set(out)
            head = [i for i in self.queue.tolist() if i not in taken][: k - len(out)]
            chosen = set(head)
            out += head
            self.queue = torch.tensor([i for i in self.queue.tolist() if i not in chosen],
                                      dtype=torch.long)
        return out

    def update(self, idx: list[int], group_pass_rates: list[float]) -> None:
        """Fold each prompt's newest group pass rate into its moving average."""
        for i, p in zip(idx, group_pass_rates):
            if self.visits[i] == 0:
                self.pass_rate[i] = p
            else:
                self.pass_rate[i] = (1 - self.decay) * self.pass_rate[i] + self.decay * p
            self.visits[i] += 1

    def state_dict(self) -> dict:
        return {"pass_rate": self.pass_rate.clone(), "visits": self.visits.clone(),
                "queue": self.queue.clone()}

    def load_state_dict(self, s: dict) -> None:
        self.pass_rate.copy_(s["pass_rate"])
        self.visits.copy_(s["visits"])
        self.queue = s.get("queue", torch.zeros(0, dtype=torch.long)).clone()
