"""YAML read with aliases bounded before anything expands them.

PyYAML shares an aliased node instead of copying it, so ``yaml.safe_load`` of an alias bomb
(each level a list of ten aliases of the one before) returns quickly; the expansion happens
later, when the config is copied, compared or written out, and then takes minutes and all the
memory. Here the composed node graph is measured as it would expand (memoised, so a bomb costs
as little as its text) and refused past ``MAX_NODES`` values, ``MAX_DEPTH`` levels, or an
alias that refers to a node containing it.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_NODES = 100_000
MAX_DEPTH = 64


class YAMLTooLarge(yaml.YAMLError):
    """The document would expand past the bounds; ``problem`` says which."""

    problem_mark = None

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _measure(node: yaml.Node, memo: dict[int, int], path: set[int], depth: int) -> int:
    """How many nodes ``node`` stands for once every alias is expanded."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in path:
        raise YAMLTooLarge("an alias refers to a node that contains it")
    if depth > MAX_DEPTH:
        raise YAMLTooLarge(f"values nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, yaml.SequenceNode):
        children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
        children = [x for pair in node.value for x in pair]
    else:
        children = []
    path.add(key)
    size = 1
    for child in children:
        size += _measure(child, memo, path, depth + 1)
        if size > MAX_NODES:
            raise YAMLTooLarge(f"aliases expand to over {MAX_NODES:,} values (an alias bomb?)")
    path.discard(key)
    memo[key] = size
    return size


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that measures each document before constructing it."""

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _measure(node, {}, set(), 0)
        return node


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with the bounds above; raises a ``yaml.YAMLError`` past them."""
    try:
        return yaml.load(text, Loader=BoundedLoader)  # (a SafeLoader subclass)
    except RecursionError:  # nesting too deep for the composer itself
        raise YAMLTooLarge(f"values nested deeper than {MAX_DEPTH} levels") from None
