"""The house rules: the package's layers have no import cycles, no module outgrows one read,
the config's fields carry their help and commands, and no environment variable or module
global selects a code path (the speed paths are the config's ``speed`` options)."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

import grpolab
from grpolab.config import Config, ConfigError, Speed, make_config, to_dict
from grpolab.config.schema import COMMANDS, command_defaults

PKG = Path(grpolab.__file__).parent
MODULES = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
           for p in PKG.rglob("*.py")}


def _imports(name: str, path: Path) -> set[str]:
    """The package's modules ``name`` imports, at module or function level."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = name.split(".")[: len(name.split(".")) - node.level + int(is_pkg)]
                base = ".".join(up + ([base] if base else []))
            targets = {base} | {f"{base}.{a.name}" for a in node.names}
        else:
            continue
        # a package's own __init__ re-exports are not a dependency of its children
        out |= {t for t in targets if t in MODULES and t != name
                and not (MODULES[t].name == "__init__.py" and name.startswith(t + "."))}
    return out


def test_no_import_cycles() -> None:
    graph = {m: _imports(m, p) for m, p in MODULES.items()}
    cycles = []
    for start, targets in graph.items():  # a module that reaches itself is on a cycle
        seen, todo = set(), list(targets)
        while todo:
            m = todo.pop()
            if m == start:
                cycles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def test_lower_layers_import_nothing_above_them() -> None:
    """core/ is pure tensor maths; the config sits on core/ and predict/ only."""
    allowed = {"core": {"core"}, "config": {"config", "core", "predict"},
               "predict": {"predict", "core"}}
    def layer(m: str) -> str:
        return m.split(".")[1] if "." in m else ""

    for m, p in MODULES.items():
        if layer(m) in allowed:
            above = {t for t in _imports(m, p) if layer(t) not in allowed[layer(m)]}
            assert not above, f"{m} imports {sorted(above)}"


def test_modules_fit_one_read() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_no_environment_variable_or_global_selects_a_code_path() -> None:
    """Only the cache folder, torchrun's and the trackers' own variables are read; Hugging
    Face's offline switches are set (never read) so nothing is downloaded."""
    allowed = {"GRPOLAB_CACHE", "WORLD_SIZE", "LOCAL_RANK", "WANDB_PROJECT", "TRACKIO_PROJECT",
               "MLFLOW_EXPERIMENT_NAME"}
    read = set()
    for p in MODULES.values():
        text = p.read_text()
        read |= set(re.findall(r"(?:environ\.get|getenv)\(\s*[\"']([A-Z_]+)", text))
        read |= set(re.findall(r"environ\[[\"']([A-Z_]+)[\"']\]", text))
    assert read <= allowed, f"environment variables read: {sorted(read - allowed)}"
    for gone in ("EARLY_EXIT", "LENGTH_BUCKETS", "HEAD_GRAD_IN_FORWARD", "SCORE_PACK",
                 "USE_MOUNT_NAMESPACE"):
        assert not any(re.search(rf"^{gone}\s*=", p.read_text(), re.MULTILINE)
                       for p in MODULES.values()), gone


def test_every_field_carries_help_and_commands() -> None:
    for f in dataclasses.fields(Config):
        assert f.metadata["help"] and "\n" not in f.metadata["help"], f.name
        assert f.metadata["commands"] and set(f.metadata["commands"]) <= set(COMMANDS), f.name
        assert set(f.metadata["defaults"]) <= set(COMMANDS) - {"workshop"}, f.name
        helps = f.metadata["helps"]  # another command's reading of the field
        assert set(helps) <= set(f.metadata["commands"]), f.name
        assert all(h and "\n" not in h for h in helps.values()), f.name


def test_train_has_a_real_models_defaults() -> None:
    """The workshop keeps its 8-token answers and 0.001 step; train takes TRL's 256 tokens."""
    assert make_config().max_new_tokens == 8 and make_config().lr == 1e-3
    train = make_config(None, {}, "train")
    assert (train.max_new_tokens, train.lr, train.out_dir) == (256, 1e-5, "runs/train")
    assert make_config(None, {"max_new_tokens": 32}, "train").max_new_tokens == 32
    assert make_config(None, {}, "eval").max_new_tokens == 256
    assert make_config(None, {}, "eval").out_dir == "runs/eval"
    assert set(command_defaults("train")) == {"out_dir", "max_new_tokens", "lr", "eval_every",
                                              "critic_lr"}


def test_speed_options_from_yaml_flags_and_the_old_key(tmp_path: Path) -> None:
    assert make_config().speed == Speed()
    c = make_config(None, {"speed": "early_exit=false, length_buckets=off"})
    assert c.speed == Speed(early_exit=False, length_buckets=False)
    y = tmp_path / "run.yaml"
    y.write_text("speed: {score_pack: false}\ncpu_pack: false\n")
    assert make_config(y).speed == Speed(score_pack=False, cpu_pack=False)
    with pytest.raises(ConfigError, match="unknown option 'early_exits'"):
        make_config(None, {"speed": "early_exits=false"})
    with pytest.raises(ConfigError, match="speed"):
        make_config(None, {"speed": "early_exit"})
    # a Config handed back (the Python API) keeps its options
    assert make_config(None, to_dict(c)).speed == c.speed


def test_speed_options_are_offered_where_a_backend_takes_them() -> None:
    """The world's backend takes no speed path and no chunked head: the workshop offers
    neither flag (a flag that does nothing would be recorded as if it had); train and eval do
    (eval samples through the fast paths; only train scores)."""
    from grpolab.app.cli import command_fields

    assert {"speed", "logit_chunk"} <= set(command_fields("train"))
    assert "speed" in command_fields("eval") and "logit_chunk" not in command_fields("eval")
    assert not {"speed", "logit_chunk"} & set(command_fields("workshop"))


def test_speed_options_reach_the_backend_and_are_recorded(tmp_path: Path) -> None:
    from grpolab.app.commands import make_backend
    from grpolab.rollout.models import load_model
    from grpolab.rollout.tinyhf import make_tiny_model
    from grpolab.run.trainer import GRPOTrainer

    path = make_tiny_model(tmp_path / "m", hidden=32, heads=4)
    cfg = make_config(None, {"model_path": path, "speed": "lean_forward=false,early_exit=false",
                             "steps": 1, "budget": 4, "group_size": 2, "max_new_tokens": 4,
                             "progress": False, "checkpoint_every": 0,
                             "out_dir": str(tmp_path / "run")}, "train")
    backend = make_backend(cfg, *load_model(path, device="cpu"))
    assert backend.speed == cfg.speed and backend._fast is None  # the HF forward
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(4)]
    tr = GRPOTrainer(cfg, backend, rows, [lambda prompts, completions, **k: [1.0] * len(completions)],
                     rows, out_dir=cfg.out_dir)
    records = tr.train()
    assert records[0]["speed"] == dataclasses.asdict(cfg.speed)
    saved = json.loads((Path(cfg.out_dir) / "config.json").read_text())
    assert saved["speed"] == {**dataclasses.asdict(Speed()), "lean_forward": False,
                              "early_exit": False}
    assert saved["max_new_tokens"] == 4


def test_readme_layout_names_every_module_that_exists() -> None:
    """The README's "Where is X" table matches the layout: each file it names exists, and each
    of the package's modules is named there."""
    text = (PKG.parent / "README.md").read_text()
    table = text[text.index("## Where is X"):]
    named = set()
    for cell in re.findall(r"\| ([^|]*`grpolab/[^|]*)\|\s*$", table, re.MULTILINE):
        folder = ""
        for path in re.findall(r"`([\w/]+\.py)`", cell):
            if "/" in path:
                folder = path.rsplit("/", 1)[0]
            else:  # a file of the folder named just before it in the same cell
                path = f"{folder}/{path}"
            named.add(path)
    missing = sorted(p for p in named if not (PKG.parent / p).is_file())
    assert not missing, f"README names files that do not exist: {missing}"
    modules = {str(p.relative_to(PKG.parent)) for p in PKG.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert modules <= named, f"modules the README's table leaves out: {sorted(modules - named)}"
