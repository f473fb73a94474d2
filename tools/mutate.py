"""Mutation testing: do the tests fail when the code is wrong?

Each mutant changes one site of one module (a comparison flipped, `and` for `or`, a `not`
dropped, `+` for `-`, a bool constant inverted, an `if` negated, with `--kinds const` an
int constant plus one), writes the module, runs the chosen tests with `-x`, and puts the
module back. A mutant no test kills is a *survivor*: either a behaviour no test states,
or an equivalent mutant (a redundant check, an attrs flag, a memo that only saves time),
which a reader decides. Lines inside `raise` statements are skipped: error text is
checked by the tests that match it, not by flipping its formatting.

It rewrites files in place, so run it in a throwaway clone, never in a working tree:

    git clone -q . /tmp/mut && cd /tmp/mut
    python tools/mutate.py purepp/relay.py --tests tests/test_relay.py tests/test_wire.py

`--shard K/N` runs every N-th mutant (several clones in parallel, e.g. on the GPU host
with `--marks "gpu or not gpu"`); `--only FILE` reruns the survivors listed in FILE (the
`module:line:col kind` lines it prints) against other tests.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

# A mutation changes the tree in place and returns what undoes it.
Mutation = Callable[[], Callable[[], None]]

_FLIPPED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}


def _set(node: ast.AST, field: str, value: object) -> Callable[[], None]:
    """Set `node.field` to `value`; return what sets it back."""
    old = getattr(node, field)
    setattr(node, field, value)
    return lambda: setattr(node, field, old)


def _compare(node: ast.Compare, i: int) -> Mutation:
    def mutate() -> Callable[[], None]:
        old = node.ops[i]
        node.ops[i] = _FLIPPED[type(old)]()
        return lambda: node.ops.__setitem__(i, old)

    return mutate


def _mutations(node: ast.AST) -> Iterator[tuple[str, str, Mutation]]:
    """(kind, description, mutation) for each mutation of `node` itself."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _FLIPPED:
                flipped = _FLIPPED[type(op)].__name__
                yield "cmp", f"{type(op).__name__}->{flipped}", _compare(node, i)
    elif isinstance(node, ast.BoolOp):
        other: ast.boolop = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "boolop", f"{type(node.op).__name__} flip", lambda: _set(node, "op", other)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        double = ast.copy_location(ast.UnaryOp(op=ast.Not(), operand=node.operand), node)
        yield "not", "dropped", lambda: _set(node, "operand", double)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub):
        swapped: ast.operator = ast.Sub() if isinstance(node.op, ast.Add) else ast.Add()
        yield "binop", f"{type(node.op).__name__} flip", lambda: _set(node, "op", swapped)
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield "bool", f"{node.value} flip", lambda: _set(node, "value", not node.value)
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        bumped = node.value + 1
        yield "const", f"{node.value}->{bumped}", lambda: _set(node, "value", bumped)
    elif isinstance(node, ast.If):
        negated = ast.copy_location(ast.UnaryOp(op=ast.Not(), operand=node.test), node.test)
        yield "if", "negated", lambda: _set(node, "test", negated)


def sites(tree: ast.AST, kinds: set[str]) -> list[tuple[int, int, str, Mutation]]:
    """Every mutation of `tree` of the given kinds, outside `raise` statements, in order."""
    in_raise: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            in_raise.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    found = []
    for node in ast.walk(tree):
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        if line in in_raise:
            continue
        for kind, description, mutation in _mutations(node):
            if kind in kinds:
                found.append((line, col, f"{kind} {description}", mutation))
    return sorted(found, key=lambda site: (site[0], site[1]))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("module", help="the module to mutate, relative to the clone's root")
    parser.add_argument("--tests", nargs="+", required=True, help="test files that should fail")
    parser.add_argument("--marks", default="not gpu", help="pytest -m expression")
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["cmp", "boolop", "not", "binop", "bool", "if"],
        help="mutation kinds (add const for int constants)",
    )
    parser.add_argument("--shard", default="0/1", help="K/N: the mutants whose index %% N is K")
    parser.add_argument("--only", type=Path, help="a file of survivor lines to rerun")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test run")
    args = parser.parse_args()
    root = Path.cwd()
    path = root / args.module
    source = path.read_text()
    tree = ast.parse(source)
    todo = sites(tree, set(args.kinds))
    if args.only is not None:
        wanted = {line.strip() for line in args.only.read_text().splitlines()}
        todo = [s for s in todo if f"{args.module}:{s[0]}:{s[1]} {s[2]}" in wanted]
    shard, shards = map(int, args.shard.split("/"))
    todo = todo[shard::shards]
    print(f"{len(todo)} mutants of {args.module}", flush=True)
    survivors = []
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
    try:
        for number, (line, col, description, mutation) in enumerate(todo, 1):
            undo = mutation()
            try:
                path.write_text(ast.unparse(tree))
            finally:
                undo()
            start = time.monotonic()
            try:
                run = subprocess.run(
                    [*command, "-m", args.marks, *args.tests],
                    cwd=root,
                    capture_output=True,
                    timeout=args.timeout,
                    check=False,
                )
                verdict = "killed" if run.returncode else "SURVIVED"
            except subprocess.TimeoutExpired:
                verdict = "killed (timeout)"
            finally:
                path.write_text(source)
            where = f"{args.module}:{line}:{col} {description}"
            seconds = time.monotonic() - start
            print(f"[{number}/{len(todo)}] {where}: {verdict} ({seconds:.0f} s)", flush=True)
            if verdict == "SURVIVED":
                survivors.append(where)
    finally:
        path.write_text(source)
    print(f"{len(survivors)} survivors of {len(todo)}:")
    for where in survivors:
        print(f"  {where}")


if __name__ == "__main__":
    main()
