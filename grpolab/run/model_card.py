"""The model card of a trained model: ``<out_dir>/final/README.md``, as Hugging Face repos carry.

YAML metadata (base_model, library, tags, datasets) on top, then what a reader needs to trust
or reproduce the model: the base model, the data and rewards, the config that differs from
``grpolab train``'s defaults, and the final metrics, read from the run's own files.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import yaml

from grpolab.config import Config
from grpolab.config.schema import command_defaults
from grpolab.rollout.models import hub_folder, hub_shaped

# grpolab's names for models -> their Hugging Face repositories
KNOWN_BASES = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def base_model_id(model_path: str) -> str | None:
    """The base model's Hugging Face id when it is known: a grpolab model name, or the
    ``_name_or_path`` a downloaded checkpoint's config.json keeps; None for a local model."""
    if model_path in KNOWN_BASES:
        return KNOWN_BASES[model_path]
    if hub_shaped(model_path):  # (read from the Hugging Face cache: its id is the name)
        return model_path.partition("@")[0]
    cfg = Path(model_path).expanduser() / "config.json"
    try:
        name = json.loads(cfg.read_text()).get("_name_or_path") or ""
    except (OSError, ValueError):
        name = ""
    if name.count("/") == 1 and not Path(name).expanduser().exists():
        return name
    return None


def _snapshot(model_path: str) -> str:
    """", snapshot <commit>" of a Hub id read from the local cache (a later fetch may move its
    main revision: the card says which weights were the start)."""
    if not hub_shaped(model_path):
        return ""
    try:
        return f", snapshot `{Path(hub_folder(model_path)).name}`"
    except FileNotFoundError:
        return ""


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3f}"
    return str(v)


def model_card(cfg: Config, summary: dict[str, Any], records: list[dict],
               heldout: int | None = None) -> str:
    """The card's text (Markdown with YAML front matter); ``heldout``: the number of held-out
    prompts evaluated (at most ``eval_size``)."""
    base = base_model_id(cfg.model_path)
    meta: dict[str, Any] = {"library_name": "transformers",
                            "tags": ["grpolab", "grpo", "reinforcement-learning", "rlvr"]}
    if base:
        meta["base_model"] = base
    if cfg.dataset.startswith("reasoning_gym:"):
        meta["tags"].append(cfg.dataset.replace(":", "-"))
    defaults = dataclasses.asdict(Config(**command_defaults("train")))  # grpolab train's
    changed = {k: v for k, v in dataclasses.asdict(cfg).items()
               if v != defaults.get(k) and k not in ("out_dir", "progress", "overwrite")}
    last = next((r for r in reversed(records) if r.get("step", 0) >= 1), {})
    lines = [
        "---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "",
        f"# {Path(cfg.out_dir).name}: GRPO from {base or Path(cfg.model_path).name}", "",
        (f"Trained with grpolab for {summary.get('steps', 0)} GRPO steps "
        f"({cfg.group_size} answers per prompt, {cfg.prompts_per_step} prompts per step"
        f"{', LoRA rank ' + str(cfg.lora_r) + ' merged into the weights' if cfg.lora else ''})."),
        "", "## Base model", "",
        f"- `{cfg.model_path}`" + (f" (Hugging Face: `{base}`{_snapshot(cfg.model_path)})"
                                   if base else ""),
        f"- dtype {cfg.dtype}", "",
        "## Data and rewards", "",
        (f"- training prompts: `{cfg.dataset}` (column `{cfg.prompt_column}`, answers from "
        f"`{cfg.answer_column}`)"),
        f"- held-out prompts: `{cfg.eval_dataset or 'none'}`"
        + (f" ({heldout} prompts)" if cfg.eval_dataset and heldout is not None else ""),
        f"- rewards: {', '.join(f'`{r}`' for r in cfg.rewards)}"
        + (f" (weights {cfg.reward_weights})" if cfg.reward_weights else ""),
        "", "## Final metrics", "",
        "| measure | start | end |", "|---|---|---|",
        (f"| held-out accuracy (greedy) | {_fmt(summary.get('start_heldout_acc', math.nan))} | "
        f"{_fmt(summary.get('final_heldout_acc', math.nan))} |"),
    ]
    if "start_heldout_check_acc" in summary:
        lines.append(f"| held-out strict check ({cfg.watch_reward}) | "
                     f"{_fmt(summary['start_heldout_check_acc'])} | "
                     f"{_fmt(summary['final_heldout_check_acc'])} |")
    lines += [
        "", (f"Mean training reward over the run {_fmt(summary.get('mean_reward', math.nan))}; "
        f"mean dead-group share {_fmt(summary.get('mean_dead_share', math.nan))}; "
        f"answers generated {summary.get('answers_generated', 0)}."),
    ]
    if last:
        keep = ("reward_mean", "accuracy_train", "dead_share", "completion_len", "kl", "loss")
        lines += ["", f"Last step ({last['step']}): " + ", ".join(
            f"{k} {_fmt(float(last[k]))}" for k in keep if isinstance(last.get(k), (int, float)))
            + "."]
    if summary.get("hacking_suspected_steps"):
        lines += ["", (f"**Reward hacking suspected** at steps {summary['hacking_suspected_steps']}"
                  " (training reward rose beyond the strict held-out check).")]
    lines += ["", "## Config (keys that differ from `grpolab train`'s defaults)", "", "```yaml",
              yaml.safe_dump(changed, sort_keys=True).strip(), "```", "",
              "## Use", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "", 'model = AutoModelForCausalLM.from_pretrained("path/to/final")',
              'tokenizer = AutoTokenizer.from_pretrained("path/to/final")', "```", ""]
    if cfg.lora:
        lines[-1:-1] = ["", ("The LoRA adapters alone are in `adapter/` (load with "
                        "`peft.PeftModel.from_pretrained`).")]
    return "\n".join(lines) + "\n"


def write_model_card(final_dir: str | Path, cfg: Config, summary: dict[str, Any],
                     records: list[dict], heldout: int | None = None) -> Path:
    """Write ``final_dir/README.md``; returns its path."""
    path = Path(final_dir) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(model_card(cfg, summary, records, heldout))
    return path
