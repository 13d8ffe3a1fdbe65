"""How the ``code`` verifier judges a test without trusting the answer's process.

Each test is parsed (``plan_test``) into the expressions the sandbox must compute (steps) and
the checks on their values (terms), which run here: the sandbox only sends values back as plain
JSON and never sees an expected value, so nothing the answer does in its own
process (an ``__eq__`` that is always true, patched builtins) can turn a wrong value into a
pass. What cannot be judged this way makes ``plan_test`` return None: the test counts as not
passed and the verdict says so.
"""

from __future__ import annotations

import ast
import copy
import functools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from grpolab.rewards.code_data import same_output
from grpolab.rewards.fold import fold
from grpolab.rewards.shapes import (
    defined_names,
    is_literal,
    is_pytest_import,
    literal_bindings,
    loop_assert,
    raises_block,
)


class _Unjudgeable(Exception):
    """A test that cannot be judged outside the answer's process."""


# Functions a check may apply here to a value from the sandbox (bounded work on plain values)
_FUNCS = {"len": len, "sorted": sorted, "set": set, "frozenset": frozenset, "tuple": tuple,
          "list": list, "abs": abs, "round": round, "sum": sum, "min": min, "max": max,
          "bool": bool, "int": int, "float": float, "str": str, "any": any, "all": all,
          "dict": dict}
SHADOWABLE = frozenset([*_FUNCS, "isclose"])  # names a test may mean as the answer's own
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
# Functions that take any iterable as their first argument: a generator, map or range the
# answer returns is made a list in the sandbox (an "iter" step) so that it can be sent here
_ITERABLE_ARG = {"list", "tuple", "set", "frozenset", "sorted", "sum", "min", "max", "any", "all",
                 "dict"}
# Judgements: in the sandbox the answer would make them (an __eq__, a patched all), so an
# expression sent there may hold none (they run here, or the test is not checkable)
_JUDGING = (ast.Compare, ast.BoolOp, ast.IfExp)
_JUDGING_CALLS = {"isclose", "isinstance", "issubclass", "all", "any", "callable", "hasattr",
                  "bool"}
MAX_UNROLL = 1_000  # items a comprehension over literals is unrolled into
MAX_MATCH = 10_000  # characters of an exception's text searched ('.*x' on 256 KB: 30 s here)
# Methods of plain values, called here on the value the sandbox sends (there they would be the
# answer's own: a str subclass whose startswith always says yes); pure, bounded by their inputs
_METHODS = {"startswith", "endswith", "lower", "upper", "strip", "lstrip", "rstrip", "split",
            "rsplit", "splitlines", "count", "find", "rfind", "index", "rindex", "isdigit",
            "isalpha", "isalnum", "isspace", "islower", "isupper", "istitle", "isdecimal",
            "isnumeric", "title", "capitalize", "casefold", "swapcase", "keys", "values",
            "items", "get", "join"}
_VERDICT = {m for m in _METHODS if m[:2] == "is" or m[-4:] == "with"}  # verdicts: never there
_PLAIN_TYPES = (str, bytes, list, tuple, dict, set, frozenset)


@dataclass
class Plan:
    # ("exec", statement) / ("eval", expression) / ("iter", expression, sent as a list if
    # it is an iterator) / ("raises", statements) / ("stdio", input), in order
    steps: list[tuple[str, str]]  # (and "bind:_hN": ``_hoisted``; "keep:_kN": ``_either``)
    checks: list[Any]  # one term per check, over the values the steps send (``_values``)
    modules: frozenset[str] = frozenset()  # names the test imports (re.split is re's)
    shadow: frozenset[str] = frozenset()  # names of _FUNCS the answer defines (its own `sum`)
    literals: dict[str, Any] = field(default_factory=dict)  # the test's (``literal_bindings``)


@functools.lru_cache(maxsize=4096)  # a group's G answers share a prompt's tests: parsed once
def plan_test(test: str, shadow: frozenset[str] = frozenset()) -> Plan | None:
    """The test as steps for the sandbox and checks for here, or None if it cannot be
    judged outside the answer's process (shared between calls: read, never changed)."""
    try:
        tree = fold(ast.parse(test), shadow)  # `[0] * 3`: a literal, made here
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    plan = Plan([], [], shadow=shadow & SHADOWABLE - defined_names(test))  # (not the test's)
    binds = literal_bindings(tree.body, SHADOWABLE - plan.shadow)
    try:
        for node, plan.literals in zip(tree.body, binds):
            node = loop_assert(node) or node
            if is_pytest_import(node):
                continue  # (not in the sandbox: its raises is read here)
            if (raises := raises_block(node)) and not any(map(_judges, raises[2])):  # (else
                plan.steps.append(("raises", "\n".join(map(ast.unparse, raises[2]))))
                plan.checks.append(("raises", _values(plan) - 1, *raises[:2]))  # not judged)
            elif isinstance(node, ast.Assert):
                plan.checks.append(_term(node.test, plan, top=True))
            elif isinstance(node, (ast.Import, ast.ImportFrom, ast.Assign, ast.AnnAssign,
                                   ast.AugAssign, ast.Expr)):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    plan.modules |= {(a.asname or a.name).split(".")[0] for a in node.names}
                if _judges(node):  # `ok = f(1) == 2` then `assert ok`: judged there
                    return None
                plan.steps.append(("exec", ast.unparse(node)))  # sets up the calls' inputs
            else:
                return None
    except (_Unjudgeable, RecursionError):
        return None
    return plan if plan.checks else None


def _is_val(term: Any) -> bool:  # holds a value from the sandbox
    return isinstance(term, tuple) and term[0] != "lit" and (
        term[0] == "val" or any(_is_val(t) for t in term[1:]))


def _judges(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, _JUDGING) or isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not):
            return True
        if isinstance(n, ast.Call) and (getattr(n.func, "id", None) in _JUDGING_CALLS
                                        or getattr(n.func, "attr", None) in _JUDGING_CALLS):
            return True
    return False


def _term(node: ast.expr, plan: Plan, top: bool = False, iterable: bool = False) -> Any:
    return _fold(_term_raw(node, plan, top, iterable))


def _term_raw(node: ast.expr, plan: Plan, top: bool = False, iterable: bool = False) -> Any:
    """A check over sandbox values; sub-expressions it cannot compute here are evaluated
    by the sandbox (as long as the expected side stays here). ``iterable``: the value is
    only iterated here, so an iterator may come back as a list."""
    if isinstance(node, ast.Name) and node.id in plan.literals:  # `expected`, bound to one
        return ("lit", plan.literals[node.id])
    try:  # a literal, computed here
        return ("lit", ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
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
            value = _term(node.value, plan)
            return _either(("item", value, index), value, f"_k[{ast.unparse(node.slice)}]", plan)
    if isinstance(node, ast.Call) and not any(k.arg is None for k in node.keywords):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "math" else None)
        if isinstance(func, ast.Name) and name in plan.shadow:  # the answer's `sum`: on literals
            if not all(map(is_literal, [*node.args, *(k.value for k in node.keywords)])):
                raise _Unjudgeable  # the function under test; around its values its own judge
            name = None
        kwargs = {k.arg: _term(k.value, plan) for k in node.keywords}
        if name == "isclose" and len(node.args) == 2 and all(
                k in ("rel_tol", "abs_tol") and v[0] == "lit" for k, v in kwargs.items()):
            a, b = (_term(n, plan) for n in node.args)
            if _is_val(a) and _is_val(b):
                raise _Unjudgeable
            return ("isclose", a, b, {k: v[1] for k, v in kwargs.items()})
        if isinstance(func, ast.Attribute) and func.attr in _METHODS \
                and _root(func.value) not in {"math", *plan.modules} \
                and all(v[0] == "lit" for v in kwargs.values()) \
                and not any(isinstance(a, ast.Starred) for a in node.args):
            receiver = _term(func.value, plan)
            args = [_term(a, plan, iterable=func.attr == "join") for a in node.args]
            term = ("method", func.attr, {k: v[1] for k, v in kwargs.items()}, receiver, *args)
            op = ast.Call(ast.Attribute(ast.Name("_k"), func.attr), node.args, node.keywords)
            return term if func.attr in _VERDICT else _either(term, receiver, ast.unparse(op), plan)
        if isinstance(func, ast.Name) and name in _FUNCS and not kwargs \
                and not any(isinstance(a, ast.Starred) for a in node.args):
            # min(a, b) compares its arguments: only a lone one (or sum's first) is iterated
            its = name in _ITERABLE_ARG and (len(node.args) == 1 or name == "sum")
            args = [_term(a, plan, iterable=its and i == 0) for i, a in enumerate(node.args)]
            op = ast.Call(ast.Name(name), [ast.Name("_k"), *node.args[1:]], [])
            return _either(("call", name, *args), args[0] if args else ("lit",), ast.unparse(op),
                           plan)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)) \
            and not any(isinstance(e, ast.Starred) for e in node.elts):
        return ("show", type(node).__name__, *[_term(e, plan) for e in node.elts])
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        unrolled = _unroll(node, plan)
        if unrolled is not None:
            return unrolled
    if isinstance(node, (ast.Lambda, ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom)) \
            or _judges(node):
        raise _Unjudgeable
    node = _hoisted(node, plan)
    plan.steps.append(("iter" if iterable else "eval", ast.unparse(node)))
    return ("val", _values(plan) - 1)


def _values(plan: Plan) -> int:  # how many of the steps send a value
    return sum(k in ("eval", "iter", "raises") or k[:5] == "keep:" for k, _ in plan.steps)


def _either(term: Any, operand: Any, op: str, plan: Plan) -> Any:
    """``term``, made here on the operand's plain value, or where the operand is the answer's
    own object (or too big to send) ``op`` made there on it: its own ``get``, ``__len__``."""
    if operand[0] != "val" or plan.steps[-1][0] != "eval" or operand[1] != _values(plan) - 1:
        return term  # (only an operand computed by the step just before)
    name = f"_k{len(plan.steps)}"
    plan.steps[-1] = (f"keep:{name}", plan.steps[-1][1])
    plan.steps.append(("eval", op.replace("_k", name, 1)))
    return ("either", operand[1], term, ("val", _values(plan) - 1))


def _hoisted(node: ast.expr, plan: Plan) -> ast.expr:
    """``node`` with the arguments of its library calls (``heapq.nsmallest(2, f())``: a
    function the test imports) that call anything made steps of their own ("bind:_hN",
    before it): the answer's code then runs in those steps and never inside the library's
    call, which gets their plain values with the library put back first (the answer could
    otherwise patch, from within ``f()``, what ``nsmallest`` is about to use)."""
    def library(call: ast.Call) -> bool:
        return _root(call.func) in plan.modules

    class Hoist(ast.NodeTransformer):
        def visit_Call(self, call: ast.Call) -> ast.expr:
            self.generic_visit(call)  # inner calls first: their binds come before
            if library(call):
                call.args = [self.bind(a) for a in call.args]
                for k in call.keywords:
                    k.value = self.bind(k.value)
            return call

        def bind(self, arg: ast.expr) -> ast.expr:
            if isinstance(arg, ast.Starred) or not any(
                    isinstance(n, ast.Call) for n in ast.walk(arg)):
                return arg
            name = f"_h{sum(kind.startswith('bind:') for kind, _ in plan.steps)}"
            plan.steps.append((f"bind:{name}", ast.unparse(arg)))
            return ast.Name(name, ast.Load())

    if not any(isinstance(n, ast.Call) and library(n) for n in ast.walk(node)):
        return node
    return ast.fix_missing_locations(Hoist().visit(copy.deepcopy(node)))


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (``os`` of ``os.path``), if any."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _unroll(node: ast.ListComp | ast.SetComp | ast.GeneratorExp, plan: Plan) -> Any:
    """A comprehension whose loops run over values known here (``for i in range(5)``), as
    the display of its items: ``[f(i) == 2 * i for i in range(3)]`` is ``[f(0) == 0, f(1) ==
    2, f(2) == 4]``, each call sent to the sandbox, each comparison made here. None if a
    loop runs over the answer's values or a condition needs them."""
    items: list[Any] = []

    def walk(gens: list[ast.comprehension], bound: dict[str, Any]) -> bool:
        if not gens:
            items.append(_term(_bind(node.elt, bound), plan))
            return True
        gen, rest = gens[0], gens[1:]
        if gen.is_async:
            raise _Unjudgeable
        values = _source(_bind(gen.iter, bound))
        if values is None:
            return False
        for value in values:
            if len(items) >= MAX_UNROLL:
                raise _Unjudgeable
            inner = {**bound, **_assign(gen.target, value)}
            conds = [_fold(_term_raw(_bind(c, inner), Plan([], []))) for c in gen.ifs]
            if any(c[0] != "lit" for c in conds):
                return False
            if all(c[1] for c in conds) and not walk(rest, inner):
                return False
        return True

    before = len(plan.steps)
    if not walk(list(node.generators), {}):
        del plan.steps[before:]
        return None
    kind = {ast.ListComp: "List", ast.SetComp: "Set", ast.GeneratorExp: "gen"}[type(node)]
    return ("show", kind, *items)


def _source(node: ast.expr) -> Any:
    """What a comprehension's loop runs over, if it is known here (literals, ``range`` of
    literals, at most MAX_UNROLL items), else None."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "range" \
            and not node.keywords and 1 <= len(node.args) <= 3:
        args = [_fold(_term_raw(a, Plan([], []))) for a in node.args]
        if not all(a[0] == "lit" and type(a[1]) is int for a in args):
            return None
        values = range(*[a[1] for a in args])
    else:
        term = _fold(_term_raw(node, Plan([], [])))
        if term[0] != "lit":
            return None
        values = term[1]
    if not isinstance(values, (range, list, tuple, set, frozenset, dict, str, bytes)) \
            or len(values) > MAX_UNROLL:
        raise _Unjudgeable
    return values


def _assign(target: ast.expr, value: Any) -> dict[str, Any]:
    """The loop variables ``for <target> in ...`` binds to ``value``."""
    if isinstance(target, ast.Name):
        return {target.id: value}
    if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (tuple, list, str)) \
            and len(value) == len(target.elts):
        out: dict[str, Any] = {}
        for t, v in zip(target.elts, value):
            out.update(_assign(t, v))
        return out
    raise _Unjudgeable


def _bind(node: ast.expr, bound: dict[str, Any]) -> ast.expr:
    """``node`` with the loop variables in ``bound`` replaced by their values' literals."""
    if not bound:
        return node
    for n in ast.walk(node):  # a nested scope that binds the same name again: not followed
        names = [a.arg for a in ast.walk(n.args) if isinstance(a, ast.arg)] if isinstance(n, ast.Lambda) \
            else [x.id for g in getattr(n, "generators", []) for x in ast.walk(g.target)
                  if isinstance(x, ast.Name)]
        if set(names) & set(bound):
            raise _Unjudgeable

    class Sub(ast.NodeTransformer):
        def visit_Name(self, name: ast.Name) -> ast.expr:
            if name.id in bound and isinstance(name.ctx, ast.Load):
                return _literal(bound[name.id])
            return name

    return ast.fix_missing_locations(Sub().visit(copy.deepcopy(node)))


def _literal(value: Any) -> ast.expr:
    """The expression that writes ``value``, if it has one (plain values, not ``nan``)."""
    try:
        node = ast.parse(repr(value), mode="eval").body
        back = ast.literal_eval(node)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError) as e:
        raise _Unjudgeable from e
    if type(back) is not type(value) or back != value:
        raise _Unjudgeable
    return node


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
    if kind == "show":  # a display (or comprehension) over values from the sandbox
        items = [_eval(t, values) for t in term[2:]]  # every value must have come
        return iter(items) if term[1] == "gen" else \
            {"List": list, "Tuple": tuple, "Set": set}[term[1]](items)
    if kind == "method":  # a plain type's own method, whatever the value's type claimed
        receiver, args = _eval(term[3], values), [_eval(t, values) for t in term[4:]]
        if type(receiver) not in _PLAIN_TYPES or not hasattr(type(receiver), term[1]):
            raise TypeError("not a plain value's method")
        return getattr(type(receiver), term[1])(receiver, *args, **term[2])
    if kind == "stdout":
        return same_output(_eval(term[1], values), term[2])
    if kind == "raises":  # [the builtin exception classes it is an instance of, its text]
        got = values[term[1]]
        return bool(got) and any(n in got[0] for n in term[2]) and (
            term[3] is None or re.search(term[3], str(got[1])[:MAX_MATCH]) is not None)
    if kind == "either":  # the plain operand's, else the answer's object's own (``_either``)
        return _eval(term[2], values) if term[1] in values else values[term[3][1]]
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


def passes(plan: Plan | None, values: dict[int, Any]) -> bool:
    try:
        return plan is not None and all(bool(_eval(check, values)) for check in plan.checks)
    except Exception:  # noqa: BLE001 - a missing value, a type mismatch: not a pass
        return False
