"""PPO's value model: a copy of the policy's model at the start of the run whose LM head is
replaced by a linear map to one number, so its "logits" at the position before an answer token
are the value of the text so far.

A separate copy, not a head on the policy's own trunk: the policy's forward and sampling stay
as they are, and the critic's training cannot move the policy. What trains is what trains in
the policy (with LoRA, the copy's own adapters on the frozen copied base; without, every
weight) plus the value head, which starts at 0. It costs a second copy of the base weights in
memory; GRPO's case is exactly that it needs none.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from grpolab.rollout.batch import Rollout
from grpolab.rollout.logprobs import completion_logits


def _output_owner(model: nn.Module) -> tuple[nn.Module, str]:
    """The module holding the LM head and its attribute name (TinyGPT's ``head``, a
    transformers model's output embeddings, under a peft wrapper or not)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "get_output_embeddings") and inner.get_output_embeddings() is not None:
        head = inner.get_output_embeddings()
        for name, mod in inner.named_modules():
            if mod is head:
                parent, _, attr = name.rpartition(".")
                return inner.get_submodule(parent) if parent else inner, attr
    if isinstance(getattr(inner, "head", None), nn.Linear):
        return inner, "head"
    raise ValueError(f"estimator ppo: cannot find the LM head of {type(inner).__name__}")


class Critic:
    """The value model and its optimizer; ``values`` gives V(prefix before token t), [B, Tc]."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        self.model = copy.deepcopy(model)
        owner, attr = _output_owner(self.model)
        old = getattr(owner, attr)
        head = nn.Linear(old.in_features, 1, dtype=torch.float32,
                         device=old.weight.device)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        setattr(owner, attr, head)
        self.head = head
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(self.params, lr=lr)

    def values(self, backend: Any, ro: Rollout) -> Tensor:
        """[B, Tc] on the CPU, with autograd when grad is on; 0 where the answer mask is 0."""
        lm = backend.forward_of(self.model, ro.prompt_ids.shape[1] + ro.completion_ids.shape[1])
        v = completion_logits(lm, ro, backend.device, share_prompts=False)[..., 0].float()
        return v.cpu() * ro.completion_mask

    def state_dict(self) -> dict[str, Any]:
        return {"trainable": {n: p.detach().cpu().clone()
                              for n, p in self.model.named_parameters() if p.requires_grad},
                "optimizer": self.opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, t in state["trainable"].items():
                params[n].copy_(t)
        self.opt.load_state_dict(state["optimizer"])
