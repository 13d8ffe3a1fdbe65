"""A Hugging Face sequence-classification model as a reward function (``rewards: [rm:DIR]``).

The score of an answer is the model's first logit on the prompt and the answer joined, as in
TRL's GRPOTrainer (a reward model has ``num_labels: 1``): text prompts are concatenated with
the completion, chat prompts (lists of messages) get the completion as an assistant message and
go through the reward model's own chat template. Inputs are right-padded, without special tokens
added, and truncated from the left only beyond the model's positions. The model is loaded from a
local folder only (never downloaded), runs in the trainer's process without gradients, and is
scored ``batch_size`` answers at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


class SequenceClassifierReward:
    """Callable reward: ``fn(prompts, completions, **columns) -> list[float]``."""

    in_process = True  # a local model, bounded time: no worker process, no timeout

    def __init__(self, path: str, device: str | None = None, batch_size: int = 32) -> None:
        try:
            from transformers import AutoModelForSequenceClassification, AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is in the hf extra
            raise ValueError(f"reward model rm:{path} needs transformers ({e})") from None
        from grpolab.rollout.models import check_weight_files, hub_folder, hub_shaped

        # (a Hub id: its snapshot in the local Hugging Face cache, as for the policy)
        try:
            folder = Path(hub_folder(path, "reward model") if hub_shaped(path) else path)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
        folder = folder.expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"reward model rm:{path}: no config.json there (a local Hugging "
                             "Face sequence-classification model folder is expected)")
        check_weight_files(str(folder))  # safetensors only, as for the policy
        # A causal LM's folder would load with a fresh, random score head: random rewards.
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
        if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ValueError(f"reward model rm:{path} is a {', '.join(archs)}, not a "
                             "sequence-classification model (its score head would be random)")
        self.tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        self.model, info = AutoModelForSequenceClassification.from_pretrained(
            folder, local_files_only=True, use_safetensors=True, output_loading_info=True)
        self.model.eval()
        if info.get("missing_keys"):
            raise ValueError(f"reward model rm:{path}: its weights lack "
                             f"{', '.join(sorted(info['missing_keys'])[:3])}: those would be "
                             "random (a reward model's folder holds its trained score head)")
        if self.tokenizer.pad_token is None:  # batches need one; the model must know it
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if getattr(self.model.config, "pad_token_id", None) is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"  # keep the answer when something must go
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.max_length = getattr(self.model.config, "max_position_embeddings", None)
        self.batch_size = max(1, int(batch_size))
        self.__name__ = "rm_" + (folder.resolve().name or "model")

    def text(self, prompt: Any, completion: Any) -> str:
        """What the reward model reads for one answer."""
        if isinstance(prompt, list):  # chat messages
            reply = (completion if isinstance(completion, list)
                     else [{"role": "assistant", "content": str(completion)}])
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"reward model {self.__name__}: chat prompts need a tokenizer "
                                 "with a chat template")
            return self.tokenizer.apply_chat_template(prompt + reply, tokenize=False)
        return str(prompt) + str(completion)

    @torch.inference_mode()
    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        out: list[float] = []
        for lo in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(text=texts[lo : lo + self.batch_size], return_tensors="pt",
                                 padding=True, padding_side="right", add_special_tokens=False,
                                 truncation=self.max_length is not None,
                                 max_length=self.max_length)
            enc = {k: v.to(self.device) for k, v in enc.items()}
            out += self.model(**enc).logits[:, 0].float().cpu().tolist()
        return out


def load_reward_model(path: str) -> SequenceClassifierReward:
    """``rm:DIR`` in ``rewards``: the local model folder DIR as a reward function."""
    if not path.strip():
        raise ValueError("reward spec 'rm:' needs a model folder, as 'rm:path/to/model'")
    return SequenceClassifierReward(path.strip())
