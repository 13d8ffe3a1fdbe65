"""``dtype: auto`` (TRL's ModelConfig value): the checkpoint's own dtype, read from its files as
transformers reads it, and recorded resolved with the run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import grpolab
from grpolab.config import ConfigError
from grpolab.rollout.models import checkpoint_dtype


def folder(tmp_path: Path, conf: dict, weights: torch.dtype | None = None,
           name: str = "model.safetensors") -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **conf}))
    if weights is not None:
        from safetensors.torch import save_file

        save_file({"a.bias": torch.zeros(2, dtype=torch.int64),  # (not a float: skipped)
                   "b.weight": torch.zeros(2, dtype=weights),  # (the first float by name)
                   "c.norm": torch.zeros(2, dtype=torch.float32)}, str(tmp_path / name))
    return str(tmp_path)


def test_auto_reads_the_config_then_the_weights(tmp_path: Path) -> None:
    assert checkpoint_dtype(folder(tmp_path / "a", {"dtype": "bfloat16"})) == "bfloat16"
    assert checkpoint_dtype(folder(tmp_path / "b", {"torch_dtype": "float16"})) == "float16"
    assert checkpoint_dtype(folder(tmp_path / "c", {}, torch.bfloat16)) == "bfloat16"
    assert checkpoint_dtype(folder(tmp_path / "d", {})) == "float32"  # (transformers' default)
    assert checkpoint_dtype(folder(tmp_path / "auto", {"dtype": "auto"}, torch.float16)) == (
        "float16")
    # sharded: the index's first shard; an adapter file beside it is not the model's
    sharded = Path(folder(tmp_path / "s", {}, torch.bfloat16, "model-00001-of-00002.safetensors"))
    folder(sharded, {}, torch.float32, "model-00002-of-00002.safetensors")
    folder(sharded, {}, torch.float32, "adapter_model.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "z": "model-00002-of-00002.safetensors", "b.weight": "model-00001-of-00002.safetensors"}}))
    assert checkpoint_dtype(str(sharded)) == "bfloat16"
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x05\0\0\0\0\0\0\0{oops")
    with pytest.raises(ConfigError, match="cannot read .*model.safetensors"):
        checkpoint_dtype(str(tmp_path / "d"))
    assert checkpoint_dtype("model.gguf") == "float32"  # (converted to float32)
    with pytest.raises(ConfigError, match="float64 weights.*set dtype"):
        checkpoint_dtype(folder(tmp_path / "e", {}, torch.float64))


def test_a_run_with_dtype_auto_records_the_checkpoints(llama: str, tmp_path: Path) -> None:
    model = tmp_path / "bf16"
    shutil.copytree(llama, model)
    conf = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**conf, "dtype": "bfloat16"}))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    records = grpolab.train(model_path=str(model), dataset=str(data), dtype="auto",
                            rewards=["exact"], steps=1, budget=4, group_size=2,
                            max_new_tokens=4, eval_size=0, progress=False,
                            out_dir=str(tmp_path / "run"), report_to=["none"])
    assert json.loads((records.out_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_trls_bf16_beside_dtype_auto_leaves_the_checkpoint_to_decide() -> None:
    """TRL's bf16 is autocast, its dtype the weights': with dtype auto (the checkpoint's),
    bf16 neither sets grpolab's dtype nor is refused for full fine-tuning."""
    from grpolab.config import make_config

    for peft in (True, False):
        c = make_config(None, {"bf16": True, "use_peft": peft, "dtype": "auto",
                               "model_name_or_path": "m"}, "train")
        assert c.dtype == "auto"
