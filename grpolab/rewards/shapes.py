"""The shapes of a test the ``code`` verifier reads beyond a plain assert, as syntax: a loop of
one assert (``loop_assert``), an expected exception (``raises_block``), the test's names bound
to literals (``literal_bindings``), and the names the answer's code defines (``defined_names``).
Pure functions of the parsed test; sandbox_judge plans with them."""

from __future__ import annotations

import ast
from typing import Any


def parse(text: str) -> ast.Module | None:
    """``text`` parsed, or None where it is not Python (or too deep or large to parse)."""
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None


def defined_names(code: str) -> frozenset[str]:
    """The names the answer's code binds at its top level (functions, classes, assignments,
    imports): a test's ``sum(10, 15)`` then means the answer's own ``sum``."""
    if (tree := parse(code)) is None:
        return frozenset()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return frozenset(names)


def loop_assert(node: ast.stmt) -> ast.Assert | None:
    """``for x in xs: assert t`` (loops nested too) as ``assert all(t for x in xs)``, which is
    unrolled here when ``xs`` is literal."""
    loops: list[ast.comprehension] = []
    while isinstance(node, ast.For) and len(node.body) == 1 and not node.orelse:
        loops.append(ast.comprehension(node.target, node.iter, [], 0))
        node = node.body[0]
    if not loops or not isinstance(node, ast.Assert):
        return None
    return ast.Assert(ast.Call(ast.Name("all", ast.Load()), [ast.GeneratorExp(node.test, loops)],
                               []))


def is_literal(node: ast.expr) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def literal_bindings(body: list[ast.stmt], pure: frozenset[str]) -> list[dict[str, Any]]:
    """For each statement of a test, the names it has bound to literals by then
    (``expected = [3, 2, 1]``) that nothing changes: an immutable value, or a list, dict or
    set never reached through an attribute (``x.sort()``, ``x[0].append(1)``), an item store
    (``x[0][1] = 1``) or a call argument (but of ``pure`` functions), nor read outside an
    assert (``alias = x``, then ``alias.append(1)``). A check reads them here as the literals
    they are."""
    touched: set[str] = set()  # mutable values that a step could change in place
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Attribute) or (  # x.sort(); x[0] = 1; x[0][1] = 1
                    isinstance(node, ast.Subscript) and not isinstance(node.ctx, ast.Load)):
                touched |= {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Call) and getattr(node.func, "id", None) not in pure:
                touched |= {n.id for a in [*node.args, *(k.value for k in node.keywords)]
                            for n in ast.walk(a) if isinstance(n, ast.Name)}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) \
                    and not isinstance(statement, ast.Assert):
                touched.add(node.id)  # (min(x, y), tuple(x) and x itself are x)
    bound: dict[str, Any] = {}
    out = []
    for node in body:
        out.append(dict(bound))
        for n in ast.walk(node):  # whatever it (re)binds is unknown, unless a literal below
            if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                bound.pop(n.id, None)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and is_literal(node.value):
            target, value = node.targets[0], ast.literal_eval(node.value)
            pairs = [(target, value)] if isinstance(target, ast.Name) else list(zip(
                target.elts, value)) if isinstance(target, (ast.Tuple, ast.List)) and isinstance(
                value, (tuple, list)) and len(value) == len(target.elts) else []
            bound.update({t.id: v for t, v in pairs if isinstance(t, ast.Name)
                          and (_immutable(v) or t.id not in touched)})
    return out


def _immutable(v: Any) -> bool:
    return isinstance(v, (int, float, complex, str, bytes, type(None), frozenset)) or (
        isinstance(v, tuple) and all(map(_immutable, v)))


def raises_block(node: ast.stmt) -> tuple[tuple[str, ...], str | None, list[ast.stmt]] | None:
    """``with pytest.raises(E, match=m): body``, or ``try: body; assert False`` with
    ``except E: pass``, as (the exception names, the pattern or None, the body); else None."""
    if isinstance(node, ast.With) and len(node.items) == 1:
        call = node.items[0].context_expr
        if isinstance(call, ast.Call) and ast.unparse(call.func) in ("pytest.raises", "raises") \
                and len(call.args) == 1 and all(k.arg == "match" for k in call.keywords):
            match = [k.value.value for k in call.keywords if isinstance(k.value, ast.Constant)]
            names = _exception_names(call.args[0])
            if names and len(match) == len(call.keywords) and not node.items[0].optional_vars:
                return names, (match or [None])[0], node.body
    if isinstance(node, ast.Try) and len(node.handlers) == 1 and not node.orelse \
            and not node.finalbody and len(node.body) > 1:
        handler, last = node.handlers[0], node.body[-1]
        fails = ast.unparse(last) in ("assert False", "assert 0", "pytest.fail()") or (
            isinstance(last, ast.Assert) and ast.unparse(last.test) == "False")
        names = _exception_names(handler.type) if handler.type is not None else ()
        if fails and names and all(isinstance(n, ast.Pass) for n in handler.body):
            return names, None, node.body[:-1]
    return None


def is_pytest_import(node: ast.stmt) -> bool:
    return isinstance(node, ast.ImportFrom) and node.module == "pytest" or isinstance(
        node, ast.Import) and any(a.name == "pytest" for a in node.names)


def _exception_names(node: ast.expr) -> tuple[str, ...]:
    elts = node.elts if isinstance(node, ast.Tuple) else [node]
    names = tuple(getattr(n, "id", "") for n in elts)
    return names if all(n.isidentifier() for n in names) else ()
