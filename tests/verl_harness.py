"""verl's side of the equivalence tests: verl 0.9's own functions, run from its source files as
they are (importing the package would need ray, so each function is executed in a namespace of
its own, with verl's ``masked_*`` helpers and ``agg_loss`` beside it)."""

from __future__ import annotations

import ast
import importlib.util
import math
import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import pytest
import torch


def verl_functions(*names: str) -> dict[str, Any]:
    """verl 0.9's functions ``names`` from trainer/ppo/core_algos.py and utils/
    torch_functional.py (its masked helpers, its lr schedules), executed as written
    (decorators left off)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("verl is not installed: pip install --no-deps verl==0.9.1 (.ci/run does)")
    root = Path(spec.submodule_search_locations[0])
    ns: dict[str, Any] = {"torch": torch, "defaultdict": defaultdict, "Optional": Optional,
                          "Any": Any, "AlgoConfig": type("AlgoConfig", (), {}),
                          "ActorConfig": object,  # the tests' configs are namespaces
                          "math": math, "Optimizer": torch.optim.Optimizer,
                          "LambdaLR": torch.optim.lr_scheduler.LambdaLR}  # (the schedules')
    ns.update(np=np, os=os, get_device_name=lambda: "cpu")  # (groupwise's, on the CPU)
    helpers = ("masked_sum", "masked_mean", "masked_var", "masked_whiten")
    grouped = ("_resolve_device", "_to_1d_numpy_object_array", "as_torch_index", "group_mean_std")
    names = (*names, "agg_loss") if "agg_loss" not in names else names
    for file, wanted in (("utils/torch_functional.py", (*helpers, *names)),
                         ("utils/groupwise.py", grouped),  # (the vectorized estimators')
                         ("trainer/ppo/core_algos.py", names)):
        tree = ast.parse((root / file).read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name in wanted:
                node.decorator_list = []
                exec(compile(ast.Module([node], []), file, "exec"), ns)  # noqa: S102 - verl's code
    ns["verl_F"] = SimpleNamespace(**{h: ns[h] for h in helpers if h in ns})
    return ns
