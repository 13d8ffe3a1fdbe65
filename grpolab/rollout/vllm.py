"""vLLM rollouts: ``rollout_backend: vllm`` samples with an in-process vLLM engine on a GPU.

Scoring and training stay in PyTorch (``rollout.hf.HFBackend``); only ``sample`` changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from grpolab.rollout.hf import HFBackend
from grpolab.rollout.sampling import draw_seed


def check_vllm() -> None:
    """Fail fast, on one line, when vLLM rollouts cannot run here."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        ok = False
    else:
        ok = torch.cuda.is_available()
    if not ok:
        raise ValueError("rollout_backend 'vllm' needs the vllm package and a CUDA GPU; "
                         "use rollout_backend: hf (HF generate, works on CPU)")


class VLLMBackend(HFBackend):
    """HFBackend whose rollouts come from a vLLM engine in this process (TRL's "colocate" mode);
    scoring and training stay in PyTorch.

    Before each ``generate`` the current weights (LoRA merged in, then unmerged) are pushed into
    the engine under the plain model's parameter names, and its prefix cache is reset (cached
    prompt keys were computed by the old weights). Every answer gets its own sampling seed,
    drawn from the trainer's generator, so a group's G answers differ and a run repeats.
    Tested here against a stand-in engine (no GPU): the glue, not vLLM itself. The weight push
    goes through ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights``,
    the path TRL uses; other vLLM versions may need another.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, model_path: str, **kwargs: Any) -> None:
        check_vllm()
        from vllm import LLM

        super().__init__(model, tokenizer, **kwargs)
        self.llm = LLM(model=model_path, gpu_memory_utilization=0.4, enable_prefix_caching=True,
                       seed=int(kwargs.get("seed", 0)))

    def engine_weights(self) -> Iterator[tuple[str, Tensor]]:
        """(name, tensor) of every weight under the plain model's names; call with LoRA merged."""
        for name, p in self.model.named_parameters():
            if "lora_" in name:
                continue
            yield name.removeprefix("base_model.model.").replace(".base_layer", ""), p.data

    def _sync_weights(self) -> None:
        if self.lora:
            self.model.merge_adapter()
        try:
            engine = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
            engine.load_weights(self.engine_weights())
        finally:
            if self.lora:
                self.model.unmerge_adapter()
        self.llm.reset_prefix_cache()

    def sample(self, prompt_ids: Tensor, prompt_mask: Tensor, temperature: float, max_new: int,
               generator: torch.Generator | None) -> Tensor:
        """The engine's answers [B, longest] (PAD after each), one seed per answer."""
        from vllm import SamplingParams

        self._sync_weights()
        base = draw_seed(generator, 2**31)
        # (vLLM's top_k -1 is off; it applies min-p before top-k/top-p, generate after them)
        f = self.filters
        params = [SamplingParams(temperature=float(temperature), max_tokens=int(max_new),
                                 seed=(base + i) % 2**31, stop_token_ids=list(self.eos_ids),
                                 top_k=f.top_k or -1, top_p=f.top_p, min_p=f.min_p,
                                 repetition_penalty=f.repetition_penalty)
                  for i in range(len(prompt_ids))]
        reqs = [{"prompt_token_ids": row[m.bool()].tolist()}
                for row, m in zip(prompt_ids, prompt_mask)]
        outs = self.llm.generate(reqs, params, use_tqdm=False)
        seqs = [list(o.outputs[0].token_ids) or [self.eos_ids[0]] for o in outs]
        comp = torch.full((len(seqs), max(len(s) for s in seqs)), self.pad_id, dtype=torch.long)
        for i, seq in enumerate(seqs):
            comp[i, : len(seq)] = torch.tensor(seq)
        return comp
