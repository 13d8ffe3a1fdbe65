"""How the ``code`` verifier judges a test without trusting the answer's process.

Each test is parsed (``plan_test``) into the expressions the sandbox must compute (steps) and
the checks on their values (terms), which run here: the sandbox only sends values back as plain
JSON (``decode``) and never sees an expected value, so nothing the answer does in its own
process (an ``__eq__`` that is always true, patched builtins) can turn a wrong value into a
pass. What cannot be judged this way makes ``plan_test`` return None: the test counts as not
passed and the verdict says so.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Any


class _Unjudgeable(Exception):
    """A test that cannot be judged outside the answer's process."""


# Functions a check may apply here to a value from the sandbox (bounded work on plain values)
_FUNCS = {"len": len, "sorted": sorted, "set": set, "frozenset": frozenset, "tuple": tuple,
          "list": list, "abs": abs, "round": round, "sum": sum, "min": min, "max": max,
          "bool": bool, "int": int, "float": float, "str": str, "any": any, "all": all,
          "dict": dict}
_CONSTS = {"inf": math.inf, "nan": math.nan, "pi": math.pi, "e": math.e, "tau": math.tau}
_CMP = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
        ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
        ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
        ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
        ast.Is: lambda a, b: a is b, ast.IsNot: lambda a, b: a is not b}
_ARITH = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
          ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
          ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b,
          ast.Pow: lambda a, b: a ** _small(b)}
_NUMBER = (int, float)


@dataclass
class Plan:
    steps: list[tuple[str, str]]  # ("exec", statement) / ("eval", expression), in order
    checks: list[Any]  # one term per assert, over the values of the "eval" steps


def plan_test(test: str) -> Plan | None:
    """The test as steps for the sandbox and checks for here, or None if it cannot be
    judged outside the answer's process."""
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    plan = Plan([], [])
    try:
        for node in tree.body:
            if isinstance(node, ast.Assert):
                plan.checks.append(_term(node.test, plan, top=True))
            elif isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign,
                                   ast.AugAssign, ast.Expr)):
                plan.steps.append(("exec", ast.unparse(node)))  # sets up the calls' inputs
            else:
                return None
    except (_Unjudgeable, RecursionError):
        return None
    return plan if plan.checks else None


def _is_val(term: Any) -> bool:  # holds a value from the sandbox
    return isinstance(term, tuple) and term[0] != "lit" and (
        term[0] == "val" or any(_is_val(t) for t in term[1:]))


def _term(node: ast.expr, plan: Plan, top: bool = False) -> Any:
    return _fold(_term_raw(node, plan, top))


def _term_raw(node: ast.expr, plan: Plan, top: bool = False) -> Any:
    """A check over sandbox values; sub-expressions it cannot compute here are evaluated
    by the sandbox (as long as the expected side stays here)."""
    try:  # a literal, computed here
        return ("lit", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "math" and node.attr in _CONSTS:
        return ("lit", _CONSTS[node.attr])
    if isinstance(node, ast.Compare) and all(type(op) in _CMP for op in node.ops):
        operands = [_term(n, plan) for n in (node.left, *node.comparators)]
        if sum(_is_val(t) for t in operands) > 1:  # both sides the answer's: forgeable
            raise _Unjudgeable
        return ("cmp", tuple(type(op) for op in node.ops), *operands)
    if isinstance(node, ast.BoolOp):
        return ("and" if isinstance(node.op, ast.And) else "or",
                *[_term(v, plan, top) for v in node.values])
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ("not", _term(node.operand, plan, top))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        return ("neg" if isinstance(node.op, ast.USub) else "pos", _term(node.operand, plan))
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        return ("arith", type(node.op), _term(node.left, plan), _term(node.right, plan))
    if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
        index = _term(node.slice, plan)
        if index[0] == "lit":
            return ("item", _term(node.value, plan), index)
    if isinstance(node, ast.Call) and not any(k.arg is None for k in node.keywords):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "math" else None)
        kwargs = {k.arg: _term(k.value, plan) for k in node.keywords}
        if name == "isclose" and len(node.args) == 2 and all(
                k in ("rel_tol", "abs_tol") and v[0] == "lit" for k, v in kwargs.items()):
            a, b = (_term(n, plan) for n in node.args)
            if _is_val(a) and _is_val(b):
                raise _Unjudgeable
            return ("isclose", a, b, {k: v[1] for k, v in kwargs.items()})
        if isinstance(func, ast.Name) and name in _FUNCS and not kwargs \
                and not any(isinstance(a, ast.Starred) for a in node.args):
            return ("call", name, *[_term(a, plan) for a in node.args])
    if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)):
        raise _Unjudgeable
    plan.steps.append(("eval", ast.unparse(node)))
    return ("val", sum(kind == "eval" for kind, _ in plan.steps) - 1)


def _fold(term: Any) -> Any:
    """A term with no value of the sandbox's in it, computed now (``float('inf')``,
    ``10**9 + 7``, ``set()``)."""
    if term[0] in ("lit", "val") or _is_val(term):
        return term
    try:
        return ("lit", _eval(term, {}))
    except Exception as e:
        raise _Unjudgeable from e


def _eval(term: Any, values: dict[int, Any]) -> Any:
    kind = term[0]
    if kind == "lit":
        return term[1]
    if kind == "val":
        return values[term[1]]  # a KeyError if it raised or sent nothing usable
    if kind == "cmp":
        operands = [_eval(t, values) for t in term[2:]]
        return all(_CMP[op](a, b) for op, a, b in zip(term[1], operands, operands[1:]))
    if kind in ("and", "or"):
        results = [bool(_eval(t, values)) for t in term[1:]]  # every value must have come
        return all(results) if kind == "and" else any(results)
    if kind == "not":
        return not _eval(term[1], values)
    if kind in ("neg", "pos"):
        x = _num(_eval(term[1], values))
        return -x if kind == "neg" else x
    if kind == "arith":  # numbers only: a list times a number could be made huge here
        return _ARITH[term[1]](_num(_eval(term[2], values)), _num(_eval(term[3], values)))
    if kind == "item":
        return _eval(term[1], values)[_eval(term[2], values)]
    if kind == "isclose":
        a, b = _num(_eval(term[1], values)), _num(_eval(term[2], values))
        return math.isclose(a, b, **term[3])
    if kind == "call":
        args = [_eval(t, values) for t in term[2:]]
        if term[1] == "round" and len(args) == 2:
            _small(args[1])
        return _FUNCS[term[1]](*args)
    raise ValueError(kind)


def _small(x: Any) -> Any:
    """An exponent or ndigits that keeps the work here bounded."""
    if not isinstance(x, _NUMBER) or abs(x) > 4096:
        raise ValueError("too large")
    return x


def _num(x: Any) -> int | float:
    if not isinstance(x, _NUMBER):
        raise TypeError("not a number")
    return x


def decode(x: Any) -> Any:
    """A value from the sandbox's JSON, back to plain Python (tuples, sets, dicts, bytes and
    complex numbers come tagged)."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if isinstance(x, dict):
        ((tag, body),) = x.items()
        if tag == "d":
            return {decode(k): decode(v) for k, v in body}
        if tag == "b":
            return bytes.fromhex(body)
        if tag == "c":
            return complex(_num(body[0]), _num(body[1]))
        return {"t": tuple, "s": set, "f": frozenset}[tag](decode(v) for v in body)
    return x


def passes(plan: Plan | None, values: dict[int, Any]) -> bool:
    if plan is None:
        return False
    try:
        return all(bool(_eval(check, values)) for check in plan.checks)
    except Exception:  # noqa: BLE001 - a missing value, a type mismatch: not a pass
        return False
