"""A test's expressions that hold none of the answer's values (``[0] * 3``, ``'ab' + 'cd'``,
``(1 << 31) - 1``, ``list(range(5))``, ``math.sqrt(2)``), computed in the trainer before the
test is planned: the expected side of ``assert f(x) == [0] * 3`` is then a literal, as the
verifier needs it. Only builtins the answer does not redefine, and bounded work: a result or
an argument over ``MAX_SIZE`` items (or an int over ``MAX_BITS`` bits) is left as it is."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from grpolab.rewards.shapes import is_literal

MAX_SIZE = 10_000  # items, characters and bytes of a folded value, all through
MAX_BITS = 100_000  # bits of a folded int
CALLS = {"range": range, "list": list, "tuple": tuple, "sorted": sorted, "reversed": reversed,
         "set": set, "frozenset": frozenset, "dict": dict, "str": str, "int": int,
         "float": float, "bool": bool, "len": len, "sum": lambda xs, start=0: sum(xs, _number(start)),
         "min": min, "max": max,
         "abs": abs, "ord": ord, "chr": chr, "divmod": divmod, "round": round, "bin": bin,
         "hex": hex, "oct": oct, "zip": zip, "enumerate": enumerate}
MATH = {"sqrt": math.sqrt, "gcd": math.gcd, "floor": math.floor, "ceil": math.ceil,
        "log": math.log, "log2": math.log2, "log10": math.log10, "exp": math.exp,
        "sin": math.sin, "cos": math.cos, "hypot": math.hypot, "isqrt": math.isqrt,
        "pi": math.pi, "e": math.e, "tau": math.tau, "inf": math.inf, "nan": math.nan}
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
          ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
          ast.Pow: operator.pow, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
          ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.BitXor: operator.xor}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
PLAIN = (type(None), bool, int, float, str, bytes, list, tuple, set, frozenset, dict)


class _Unfoldable(Exception):
    pass


def _number(x: Any) -> int | float:  # sum's start: a list's would make sum quadratic
    if type(x) not in (int, float):
        raise _Unfoldable
    return x


NAMES = frozenset(CALLS)


def fold(tree: ast.AST, answers: frozenset[str]) -> ast.AST:
    """``tree`` with each largest sub-expression free of names (but the builtins of ``CALLS``
    and ``math``'s, where the answer does not define them: ``answers``) replaced by the
    literal it computes to, where it computes within bounds."""
    return _Folder(answers).visit(tree)


class _Folder(ast.NodeTransformer):
    def __init__(self, answers: frozenset[str]) -> None:
        self.answers = answers

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, ast.expr) and not isinstance(node, (ast.Constant, ast.Name)) \
                and isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
            if is_literal(node):  # already one: not computed, written and parsed again
                return node
            try:
                value = _plain(_bounded(self.value(node)))
                return ast.copy_location(ast.parse(source(value), mode="eval").body, node)
            except (_Unfoldable, ArithmeticError, ValueError, TypeError, IndexError,
                    KeyError, RecursionError, MemoryError, SyntaxError):
                pass
        return super().generic_visit(node)

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and not any(
                isinstance(e, ast.Starred) for e in node.elts):
            items = [self.value(e) for e in node.elts]
            return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
        if isinstance(node, ast.Dict) and None not in node.keys:
            return {self.value(k): self.value(v) for k, v in zip(node.keys, node.values)}
        if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "math" \
                and "math" not in self.answers and node.attr in MATH:
            return MATH[node.attr]
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            a, b = self.value(node.left), self.value(node.right)
            _bounded_binary(node.op, a, b)
            return _bounded(BINARY[type(node.op)](a, b))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](self.value(node.operand))
        if isinstance(node, ast.Subscript):
            index = node.slice
            key = slice(*(self.value(p) if p is not None else None for p in (
                index.lower, index.upper, index.step))) if isinstance(index, ast.Slice) \
                else self.value(index)
            return self.value(node.value)[key]
        if isinstance(node, ast.Call) and not any(isinstance(a, ast.Starred) for a in node.args) \
                and all(k.arg for k in node.keywords):
            name = getattr(node.func, "id", None)
            func = CALLS.get(name) if name not in self.answers else None
            if isinstance(node.func, ast.Attribute):
                func = self.value(node.func)
            if not callable(func):
                raise _Unfoldable
            args = [_bounded(self.value(a)) for a in node.args]
            kwargs = {k.arg: _bounded(self.value(k.value)) for k in node.keywords}
            return _bounded(func(*args, **kwargs))
        raise _Unfoldable


def _bounded_binary(op: ast.operator, a: Any, b: Any) -> None:
    """Refuse, before it runs, an operation whose result would be huge."""
    if isinstance(op, ast.Mult):
        seq, n = (a, b) if isinstance(b, int) else (b, a)
        if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) \
                and len(seq) * max(n, 0) > MAX_SIZE:
            raise _Unfoldable
    if isinstance(op, ast.Pow) and isinstance(a, int) and isinstance(b, int) \
            and b * max(abs(a), 2).bit_length() > MAX_BITS:
        raise _Unfoldable
    if isinstance(op, ast.LShift) and isinstance(b, int) and b > MAX_BITS:
        raise _Unfoldable


def _bounded(value: Any) -> Any:
    """``value``, if it is small: ints of at most MAX_BITS bits, and at most MAX_SIZE items,
    characters and bytes all through (``[[0] * 10**5] * 10**5`` shares one list, but is
    10**10 items to walk)."""
    budget = [MAX_SIZE]

    def spend(x: Any) -> None:
        if isinstance(x, int) and not isinstance(x, bool) and x.bit_length() > MAX_BITS:
            raise _Unfoldable
        if isinstance(x, (str, bytes, list, tuple, set, frozenset, dict, range)):
            budget[0] -= len(x)
            if budget[0] < 0:
                raise _Unfoldable
            if isinstance(x, (list, tuple, set, frozenset)):
                for item in x:
                    spend(item)
            elif isinstance(x, dict):
                for item in x.items():
                    spend(item)
    spend(value)
    return value


def _plain(value: Any) -> Any:
    """The folded value, if it is plain data all through (not a range, a zip, a function)."""
    if type(value) not in PLAIN:
        raise _Unfoldable
    if isinstance(value, dict):
        [_plain(x) for kv in value.items() for x in kv]
    elif isinstance(value, (list, tuple, set, frozenset)):
        [_plain(x) for x in value]
    return value


def source(value: Any) -> str:
    """Python source for a plain value (``float('inf')`` where ``repr`` writes ``inf``)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    if isinstance(value, (list, tuple)):
        items = ", ".join(map(source, value)) + (
            "," if type(value) is tuple and len(value) == 1 else "")
        return f"[{items}]" if isinstance(value, list) else f"({items})"
    if isinstance(value, (set, frozenset)) and value:
        text = "{" + ", ".join(map(source, value)) + "}"
        return text if isinstance(value, set) else f"frozenset({text})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{source(k)}: {source(v)}" for k, v in value.items()) + "}"
    return repr(value)
