"""A relay-like one-rank effect program for comparing interpreters and their modes.

Every step a rank: packs its sampled tokens (padded to the wire width) and counts
into one int64 wire, broadcasts it from itself on the relay stream and unpacks it
(a receive of what it sent); consumes the previous step's tokens into a slot table
(a host index copied to the device, a scatter that skips -1 rows, a gather, an alias
kept one step); all-reduces a DP table asynchronously; and synchronises the main
stream. Names carry the step, so every steady step has the same structure with new
bindings. Every buffer is fully written, so contents compare exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypedDict

import numpy as np
import numpy.typing as npt

from purepp.effects.vocabulary import (
    Alias,
    AllReduce,
    Broadcast,
    BufferRef,
    Communicator,
    CopyHostToDevice,
    DType,
    Effect,
    EventRef,
    GatherRows,
    Op,
    Pack,
    PadColumns,
    RecordEvent,
    RecordStream,
    Release,
    ScatterRows,
    Section,
    StackRows,
    Stream,
    Synchronize,
    Unpack,
    WaitEvent,
    WaitStream,
    WaitWork,
    WorkRef,
)

WIDTH = 4  # wire width (spec + 1)
SLOTS = 10  # rows of the slot table
SAMPLED = BufferRef("caller.sampled")  # [n, k] int64, k <= WIDTH
NUM_SAMPLED = BufferRef("caller.num_sampled")  # [n] int32
NUM_REJECTED = BufferRef("caller.num_rejected")  # [n] int32
TABLE = BufferRef("caller.table")  # [SLOTS, WIDTH] int64, scattered into in place
ROWS = BufferRef("caller.rows")  # [3] int32 rows gathered from the table

# Binds a caller's array under a name; each interpreter supplies its own.
Bind = Callable[[BufferRef, npt.NDArray[np.int64] | npt.NDArray[np.int32]], None]


class Tag(TypedDict):
    step: int
    op: Op


def _align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def ref(step: int, what: str) -> BufferRef:
    return BufferRef(f"step{step}.{what}")


def n_at(step: int) -> int:
    """Rows at `step`: 5, with a 7-row step now and then (a second structure)."""
    return 7 if step % 9 == 4 else 5


def sampled(step: int, n: int) -> npt.NDArray[np.int64]:
    k = 1 if step % 3 == 0 else WIDTH - 1  # a plain-sampler step every third
    rows, cols = np.indices((n, k))
    tokens: npt.NDArray[np.int64] = (1000 * step + 10 * rows + cols).astype(np.int64)
    return tokens


def idx_mapping(step: int, n: int) -> npt.NDArray[np.int32]:
    """Row -> slot, distinct slots, -1 for freed rows."""
    slots = (np.arange(n) * 3 + step) % SLOTS
    return np.where(np.arange(n) % 4 == (step % 4), -1, slots).astype(np.int32)


def contribution(step: int) -> npt.NDArray[np.int32]:
    return np.array([[step + 1], [step % 3], [1], [2], [5]], dtype=np.int32)


def bind_once(bind: Bind) -> None:
    """The caller's persistent buffers."""
    bind(TABLE, np.full((SLOTS, WIDTH), -7, dtype=np.int64))
    bind(ROWS, np.array([0, 3, 9], dtype=np.int32))


def send(step: int, n: int) -> tuple[Effect, ...]:
    tag = Tag(step=step, op=Op.BROADCAST)
    relay = Stream.RELAY
    padded, counts, wire = ref(step, "padded"), ref(step, "counts"), ref(step, "wire")
    tokens_bytes = n * WIDTH * 8
    nbytes = _align(tokens_bytes) + _align(2 * n * 4)
    sections = (
        Section(buffer=padded, offset=0, shape=(n, WIDTH), dtype=DType.INT64),
        Section(buffer=counts, offset=_align(tokens_bytes), shape=(2, n), dtype=DType.INT32),
    )
    views = tuple(
        Section(buffer=ref(step, name), offset=s.offset, shape=s.shape, dtype=s.dtype)
        for name, s in zip(("tokens", "counts_seen"), sections, strict=True)
    )
    return (
        WaitStream(**tag, stream=relay, waits_for=Stream.MAIN),
        PadColumns(**tag, source=SAMPLED, out=padded, width=WIDTH, fill=0, stream=relay),
        StackRows(**tag, sources=(NUM_SAMPLED, NUM_REJECTED), out=counts, stream=relay),
        Pack(**tag, sections=sections, out=wire, nbytes=nbytes, stream=relay),
        Broadcast(
            **tag,
            buffer=wire,
            shape=(nbytes // 8,),
            dtype=DType.INT64,
            src=0,
            comm=Communicator.PP_RELAY,
            stream=relay,
        ),
        Unpack(**tag, source=wire, sections=views, stream=relay),
        RecordEvent(**tag, stream=relay, event=EventRef(f"step{step}.received")),
        *(RecordStream(**tag, buffer=b, stream=relay) for b in (SAMPLED, NUM_SAMPLED)),
        Release(**tag, buffer=padded),
        Release(**tag, buffer=counts),
    )  # fmt: skip


def consume(step: int, previous_n: int) -> tuple[Effect, ...]:
    """Consume step-1's tokens at `step`; release what step-1 and step-2 left."""
    tag = Tag(step=step, op=Op.CONSUME)
    main, last = Stream.MAIN, step - 1
    index, gathered = ref(step, "index"), ref(step, "gathered")
    return (
        WaitEvent(**tag, stream=main, event=EventRef(f"step{last}.received")),
        CopyHostToDevice(**tag, source=idx_mapping(last, previous_n), buffer=index, stream=main),
        ScatterRows(**tag, source=ref(last, "tokens"), index=index, target=TABLE, stream=main),
        GatherRows(**tag, source=TABLE, index=ROWS, out=gathered, stream=main),
        Alias(**tag, source=gathered, out=ref(step, "kept")),
        Release(**tag, buffer=gathered),
        Release(**tag, buffer=index),
        *(Release(**tag, buffer=ref(last, w)) for w in ("tokens", "counts_seen", "wire")),
        *((Release(**tag, buffer=ref(last, "kept")),) if last >= 1 else ()),
    )  # fmt: skip


def agree(step: int) -> tuple[Effect, ...]:
    tag = Tag(step=step, op=Op.AGREE)
    work = WorkRef(f"step{step}.agree")
    return (
        AllReduce(
            **tag,
            contribution=contribution(step),
            result=ref(step, "dp_table"),
            comm=Communicator.DP_CPU,
            work=work,
        ),
        WaitWork(**tag, work=work),
    )


def end(step: int) -> tuple[Effect, ...]:
    tag = Tag(step=step, op=Op.END_STEP)
    return (
        Release(**tag, buffer=ref(step, "dp_table")),
        Synchronize(**tag, stream=Stream.MAIN),
    )


def program(steps: int, bind: Bind) -> Iterator[tuple[Effect, ...]]:
    """The batches of `steps` steps; binds the caller's inputs before each step's send."""
    bind_once(bind)
    previous_n = 0
    for step in range(steps):
        n = n_at(step)
        if step:
            yield consume(step, previous_n)
        tokens = sampled(step, n)
        bind(SAMPLED, tokens)
        bind(NUM_SAMPLED, np.full(n, tokens.shape[1], dtype=np.int32))
        bind(NUM_REJECTED, (np.arange(n) % 2).astype(np.int32))
        yield agree(step)
        yield send(step, n)
        yield end(step)
        previous_n = n
