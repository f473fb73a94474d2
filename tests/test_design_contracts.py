"""The design's numbered contracts and layering rule, each stated once as a test.

The layering rule held but for one pair (plan and capture imported each other); the
device kernels they share now live below both, in purepp.effects.torch_kernels.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import attrs
import numpy as np
import pytest

from purepp.effects.arrays import is_frozen
from purepp.effects.vocabulary import BufferRef, Effect, EventRef, Op
from purepp.errors import PureppError
from purepp.relay import (
    PendingReceive,
    RelayConfig,
    RelayState,
    Wire,
    consume_previous_step,
    init_relay,
)
from purepp.testing import ScheduleConfig, make_schedule, simulate_schedule

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "purepp"


# ---- layering: "No two modules import each other." -------------------------------------


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """purepp modules imported at run time, at module level or inside a function
    (imports under `if TYPE_CHECKING:` are left out: they never execute)."""
    found: set[str] = set()
    pending: list[ast.AST] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules
            # `from purepp import dp` imports purepp.dp; other names come from the module itself
            found.update(submodules)
            if len(submodules) < len(node.names):
                found.add(node.module)
        pending.extend(ast.iter_child_nodes(node))
    return found


def _import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(path) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        graph[name] = _runtime_imports(tree, modules) - {name}
    return graph


def test_no_two_purepp_modules_import_each_other_at_run_time() -> None:
    """Layers: "No two modules import each other", deferred (in-function) imports included."""
    graph = _import_graph()
    mutual = sorted(
        (a, b) for a, imported in graph.items() for b in imported if a < b and a in graph[b]
    )
    assert mutual == []


# ---- contract 3: immutable arrays ----------------------------------------------------------


def _writable_arrays(value: object, path: str, seen: set[int]) -> list[str]:
    """Paths of every numpy array under `value` that is not a view of immutable memory."""
    if id(value) in seen:
        return []
    seen.add(id(value))
    if isinstance(value, np.ndarray):
        return [] if is_frozen(value) else [path]
    children: list[tuple[str, object]] = []
    cls: Any = type(value)
    if attrs.has(cls):
        children = [(f"{path}.{f.name}", getattr(value, f.name)) for f in attrs.fields(cls)]
    elif isinstance(value, (tuple, list)):
        children = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        children = [(f"{path}[{key!r}]", item) for key, item in value.items()]
    found: list[str] = []
    for child_path, child in children:
        found += _writable_arrays(child, child_path, seen)
    return found


@pytest.mark.parametrize(
    ("wire", "microbatch"),
    [(Wire.SEED, False), (Wire.PACKED, True), (Wire.FIXED, False)],
)
def test_every_array_a_simulated_world_issues_or_returns_is_frozen(
    wire: Wire, microbatch: bool
) -> None:
    """Contract 3 (immutable arrays): every array in every effect of every rank of a PP x DP
    world (relay and DP agreement alike), and in every rank's outputs, is read-only all the
    way down, so neither it nor its base can be made writable again."""
    config = ScheduleConfig(pp=2, dp=2, spec=2, steps=6, seed=5, wire=wire, microbatch=microbatch)
    run = simulate_schedule(make_schedule(config))
    seen: set[int] = set()
    writable: list[str] = []
    for rank, effects in enumerate(run.simulation.effects):
        writable += _writable_arrays(effects, f"rank {rank} effects", seen)
    writable += _writable_arrays(run.outputs, "outputs", seen)
    assert writable == []


def _pending(slots: Any, generations: Any) -> PendingReceive:
    return PendingReceive(
        step=0,
        event=EventRef("event"),
        sampled_tokens=BufferRef("sampled"),
        num_sampled=BufferRef("num_sampled"),
        num_rejected=BufferRef("num_rejected"),
        draft_tokens=None,
        idx_mapping=BufferRef("idx_mapping"),
        buffers=(),
        idx_mapping_np=slots,
        need_sampled=np.ones(len(slots), dtype=np.bool_),
        all_sampled=True,
        generations_at_receive=generations,
        rows=len(slots),
    )


_STAGE0 = RelayConfig(pp_size=2, stage=0, last_rank=1, max_num_reqs=4, num_speculative_steps=0)


def test_a_ring_entry_built_by_hand_yields_a_read_only_consumed_mapping() -> None:
    """Contract 3 (immutable arrays): a state built with the public constructors holds only
    read-only arrays, and a result handed out from it cannot be written through."""
    state = init_relay(_STAGE0)
    slots = np.array([1, 2], dtype=np.int32)  # writable, the caller's
    entry = _pending(slots, state.generations)
    step = consume_previous_step(_STAGE0, attrs.evolve(state, ring=(entry, None)))
    assert step.result is not None
    assert is_frozen(step.result.idx_mapping_np)


def test_a_generations_table_that_can_be_thawed_is_refused() -> None:
    """Contract 3 (immutable arrays): a state's array is read-only all the way down, so a
    step refuses a generations table whose base is writable memory (a read-only flag on a
    view of a caller's array is not enough: it can be set back)."""
    base = np.zeros(_STAGE0.max_num_reqs, dtype=np.int32)
    view = base.view()
    view.flags.writeable = False
    state = attrs.evolve(init_relay(_STAGE0), generations=view)
    try:
        step = consume_previous_step(_STAGE0, state)
    except PureppError:
        return
    assert is_frozen(step.state.generations), "a step accepted, and kept, a thawable table"


# ---- contract 9: errors are typed ------------------------------------------------------------


def test_a_ring_entry_naming_a_slot_outside_the_table_is_a_typed_error() -> None:
    """Contract 9 (errors are typed): bad input (here a state whose ring entry names a slot
    outside the generation table) raises a PureppError when built, never a bare
    IndexError from numpy at the consume."""
    state = init_relay(_STAGE0)
    entry = _pending(np.array([10], dtype=np.int32), state.generations)
    with pytest.raises(PureppError, match=r"^RelayState: the ring entry of step \d+ maps rows"):
        attrs.evolve(state, ring=(entry, None))


# ---- contract 2: deterministic names -------------------------------------------------------


def test_two_runs_of_one_schedule_in_one_process_issue_identical_effects() -> None:
    """Contract 2 (deterministic names): buffer, event and work names come from the state's
    step counter, not from globals, so a second run of the same schedule in the same process
    issues exactly the effects, names included, of the first."""
    schedule = make_schedule(ScheduleConfig(pp=3, dp=2, spec=1, steps=5, seed=11))
    first = simulate_schedule(schedule).simulation.effects
    second = simulate_schedule(schedule).simulation.effects
    assert first == second
    names = {str(e.buffer) for rank in first for e in rank if hasattr(e, "buffer")}
    assert names  # the comparison above did compare names


# ---- contract 8: effects say why -----------------------------------------------------------


def _steps_and_ops(effects: tuple[Effect, ...]) -> set[tuple[int, Op]]:
    return {(effect.step, effect.op) for effect in effects}


def test_each_relay_step_stamps_its_effects_with_the_states_step_and_its_own_op() -> None:
    """Contract 8 (effects say why): each effect carries the decode step it belongs to (the
    state's counter) and the operation that emitted it."""
    state: RelayState = attrs.evolve(init_relay(_STAGE0), step=7)
    entry = _pending(np.array([1, 2], dtype=np.int32), state.generations)
    consumed = consume_previous_step(_STAGE0, attrs.evolve(state, ring=(entry, None)))
    assert consumed.effects
    assert _steps_and_ops(consumed.effects) == {(7, Op.CONSUME)}
