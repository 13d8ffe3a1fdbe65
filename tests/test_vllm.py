"""grpolab.rollout.vllm.VLLMBackend against a stand-in vLLM engine (there is no GPU here).

What is ours is checked: the weights pushed to the engine (names and values, LoRA merged), the
prefix-cache reset after each push, one sampling seed per answer (a group's answers differ, and
the same generator state repeats a rollout), the rollout assembled from the engine's tokens,
and ``grpolab train`` running on it. vLLM itself is not.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from grpolab.rollout import vllm as vllm_backend
from grpolab.rollout.models import load_model
from grpolab.rollout.vllm import VLLMBackend


class FakeSamplingParams:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class FakeLLM:
    """Records what it is given; answers with tokens drawn from each request's seed."""

    vocab = 64  # answer tokens are drawn from [3, vocab)
    filters = (-1, 1.0, 0.0, 1.0)  # the SamplingParams' top_k, top_p, min_p, repetition_penalty

    def __init__(self, model: str, **kw: Any) -> None:
        self.model_path, self.kw = model, kw
        self.pushes: list[dict[str, torch.Tensor]] = []
        self.resets = 0
        runner = types.SimpleNamespace(model=types.SimpleNamespace(load_weights=self._load))
        self.llm_engine = types.SimpleNamespace(model_executor=types.SimpleNamespace(
            driver_worker=types.SimpleNamespace(model_runner=runner)))

    def _load(self, weights: Any) -> None:
        self.pushes.append({n: t.clone() for n, t in weights})

    def reset_prefix_cache(self) -> None:
        self.resets += 1

    def generate(self, reqs: list[dict], params: list[FakeSamplingParams],
                 use_tqdm: bool = True) -> list[Any]:
        assert len(reqs) == len(params) and not use_tqdm
        outs = []
        for req, p in zip(reqs, params):
            assert req["prompt_token_ids"] and p.temperature >= 0
            assert (p.top_k, p.top_p, p.min_p, p.repetition_penalty) == self.filters
            g = torch.Generator().manual_seed(p.seed)
            n = int(torch.randint(1, p.max_tokens + 1, (1,), generator=g))
            toks = torch.randint(3, self.vocab, (n,), generator=g).tolist()
            outs.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=toks)]))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("vllm")
    mod.LLM, mod.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setattr(vllm_backend, "check_vllm", lambda: None)  # no CUDA needed by the stand-in


def test_weights_seeds_and_rollouts(fake_vllm: None, llama: str) -> None:
    model, tok = load_model(llama, device="cpu")
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    be = VLLMBackend(model, tok, llama, lora=True, seed=3)
    llm = be.llm
    llm.vocab = len(tok)
    assert llm.model_path == llama and llm.kw["seed"] == 3
    with torch.no_grad():  # adapters that change the merged weights
        for n, p in be.model.named_parameters():
            if "lora_B" in n:
                p.fill_(0.01)

    prompts = ["What is 2 + 3?"] * 4 + ["What is 10 + 7? Think."] * 4
    ro = be.generate(prompts, 1.0, 6, torch.Generator().manual_seed(0))
    assert llm.resets == 1 and len(llm.pushes) == 1
    pushed = llm.pushes[0]
    assert pushed.keys() == plain.keys()  # plain names: no base_model./base_layer/lora_
    q = "model.layers.0.self_attn.q_proj.weight"
    merged = be.merged_model().state_dict()[q]
    torch.testing.assert_close(pushed[q], merged)
    assert (pushed[q] - plain[q]).abs().max() > 1e-4, "the LoRA update reached the engine"
    torch.testing.assert_close(pushed["model.norm.weight"], plain["model.norm.weight"])
    assert not any(getattr(m, "merged", False) for m in be.model.modules()), "unmerged after"

    assert ro.completion_ids.shape[0] == 8 and ro.completion_ids.shape[1] <= 6
    rows = [tuple(r[m.bool()].tolist()) for r, m in zip(ro.completion_ids, ro.completion_mask)]
    assert len(set(rows[:4])) == 4 and len(set(rows[4:])) == 4, "a group's answers differ"
    assert ro.completions[0] == tok.decode(list(rows[0]), skip_special_tokens=True)
    again = be.generate(prompts, 1.0, 6, torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, ro.completion_ids)
    assert llm.resets == 2


def test_train_runs_on_the_engine(fake_vllm: None, llama: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's sampling settings reach every request's SamplingParams (vLLM's top_k -1 is
    off, so grpolab's 0 becomes -1 above)."""
    import json

    from grpolab.app import cli

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a} + {a} =", "answer": str(2 * a)}) + "\n"
                            for a in range(8)))
    out = tmp_path / "run"
    argv = ["train", "--model-path", llama, "--dataset", str(data), "--rollout-backend", "vllm",
            "--rewards", "exact", "--steps", "2", "--budget", "8", "--group-size", "4",
            "--max-new-tokens", "5", "--out-dir", str(out), "--no-progress", "--top-k", "5",
            "--top-p", "0.9", "--min-p", "0.1", "--repetition-penalty", "1.2"]
    monkeypatch.setattr(FakeLLM, "filters", (5, 0.9, 0.1, 1.2))
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["completion_len"] > 0 for r in rows[1:])
