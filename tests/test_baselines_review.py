"""Review: the benchmark baselines every README performance ratio is taken against.

`benchmarks/seed_relay.py` (`SeedRelay`: the seed's `PPHandler` call for call, in the
`cuda_calls`, `host_calls` and `noop_calls` flavours) and `benchmarks/dp_agreement.py`
(`seed_decide`, `seed_whole`: the seed's `sync_cudagraph_and_dp_padding`) are checked
against the seed files themselves (/work/shared/seeds/000_*.txt and 004_*.txt), with the
expected calls written out by hand from the seed text for concrete steps; then against
purepp on the same schedules; then the harnesses that time them
(`benchmarks/relay_host_cost.py`, `benchmarks/pure_breakdown.py`,
`benchmarks/dp_agreement.py`) for anything that charges one side and not the other.

Method for the relay: `Recorder` is a `DeviceCalls` whose every entry records its call
(name, arguments, the stream it is issued on) and delegates to `host_calls()` (CPU
tensors, the one-rank gloo world of `benchmarks/one_rank.py`), with stream objects that
record `wait_stream`, `wait_event` and `record_event`. In a one-rank world a broadcast
moves nothing, so the recorder (or the test, after a receive) writes the sender's payload
into the received buffers, the way the wire would.

Three discrepancies this review found are fixed and are plain tests now: the CPU h2d of
`host_calls` copies (as the seed's and purepp's do), `seed_whole` builds an eager
descriptor for a forced-eager rank without dispatching (as 004 does), and
`pure_breakdown` times the receiver's consume over the seed's cycle of frees.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import pure_breakdown
from benchmarks.relay_host_cost import (
    CYCLE,
    Case,
    Contender,
    PureppRelay,
    build_contenders,
    build_inputs,
    make_interpreter,
    time_rounds,
)
from benchmarks.seed_relay import (
    DeviceCalls,
    SeedBatch,
    SeedRelay,
    cuda_calls,
    host_calls,
    noop_calls,
)
from purepp.batch import BatchFacts
from purepp.cudagraph import (
    BatchExecutionDescriptor,
    CaptureMode,
    CudaGraphDispatcher,
    CUDAGraphMode,
)
from purepp.dp import AgreementGroup, AgreementLanes, RankBatch, finish_agreement, start_agreement
from purepp.effects.torch_interpreter import TorchInterpreter
from purepp.effects.vocabulary import Broadcast, Communicator, CopyHostToDevice, Stream
from purepp.relay import Wire
from purepp.step import Step

# dp_agreement's torch calls are outside the narrow stubs in typings/: imported untyped,
# so `mypy --strict` on this file does not report the benchmark's own lines.
dpa: Any = importlib.import_module("benchmarks.dp_agreement")
overrides: Any = importlib.import_module("torch.overrides")

CPU = torch.device("cpu")
Entry = tuple[object, ...]
I32 = npt.NDArray[np.int32]


def _i32(*values: int) -> I32:
    return np.array(values, dtype=np.int32)


def _closure(fn: Callable[..., object], name: str) -> Any:
    """The value a closure of the harness captured under `name` (its relay, its table)."""
    code = fn.__code__
    cells = fn.__closure__
    assert cells is not None, fn
    return cells[code.co_freevars.index(name)].cell_contents


# ---- the recorder ---------------------------------------------------------------------------


class _Event:
    def __init__(self, name: str) -> None:
        self.name = name


class _Stream:
    """A stream that records the calls the seed makes on it."""

    def __init__(self, name: str, recorder: Recorder) -> None:
        self.name = name
        self.recorder = recorder

    def wait_stream(self, stream: object) -> None:
        self.recorder.note(("wait_stream", self.name, cast(_Stream, stream).name))

    def wait_event(self, event: object) -> None:
        self.recorder.note(("wait_event", self.name, cast(_Event, event).name))

    def record_event(self, event: object = None) -> _Event:
        made = _Event(f"ev{self.recorder.events}")
        self.recorder.events += 1
        self.recorder.note(("record_event", self.name, made.name))
        return made


class _StreamContext:
    def __init__(self, recorder: Recorder, stream: _Stream) -> None:
        self.recorder = recorder
        self.stream = stream

    def __enter__(self) -> None:
        self.recorder.note(("enter", self.stream.name))
        self.recorder.on.append(self.stream.name)

    def __exit__(self, *exc: object) -> None:
        self.recorder.on.pop()
        self.recorder.note(("exit", self.stream.name))


class Recorder:
    """Records every device call of a `SeedRelay` and delegates it to `inner`.

    `log` holds each call with its tensors named (`empty0`, `h2d1`, an input's registered
    name, or `?`); `plain` the same calls with only what the host decided (shapes asked
    for, host arrays, widths, sources, streams), comparable across flavours.
    """

    def __init__(
        self,
        inner: DeviceCalls,
        *,
        group: object = None,
        deliver: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        self.inner = inner
        self.group = group
        self.deliver = deliver
        self.log: list[Entry] = []
        self.plain: list[Entry] = []
        self.on: list[str] = []  # the stream contexts entered, innermost last
        self.sent: list[torch.Tensor] = []  # a copy of every tensor broadcast, in order
        self.events = 0
        self.counts: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._keep: list[object] = []  # keeps named objects alive: their ids stay theirs

    # -- bookkeeping
    def note(self, entry: Entry, plain: Entry | None = None) -> None:
        self.log.append(entry)
        self.plain.append(entry if plain is None else plain)

    def where(self) -> str:
        return self.on[-1] if self.on else "main"

    def name(self, obj: object, label: str) -> None:
        self._names[id(obj)] = label
        self._keep.append(obj)

    def label(self, obj: object) -> str:
        return self._names.get(id(obj), "?")

    def _made(self, kind: str, obj: object) -> str:
        k = self.counts.get(kind, 0)
        self.counts[kind] = k + 1
        label = f"{kind}{k}"
        self.name(obj, label)
        return label

    # -- the DeviceCalls entries
    def empty(self, *size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        made = self.inner.empty(*size, dtype=dtype, device=device)
        label = self._made("empty", made)
        where = self.where()
        self.note(
            ("empty", label, size, str(dtype), str(device), where),
            ("empty", size, str(dtype), str(device), where),
        )
        return made

    def as_tensor(self, data: npt.NDArray[Any], device: torch.device) -> torch.Tensor:
        made = self.inner.as_tensor(data, device=device)
        label = self._made("as_tensor", made)
        values = tuple(data.tolist())
        where = self.where()
        self.note(
            ("as_tensor", label, values, str(data.dtype), str(device), where),
            ("as_tensor", values, str(data.dtype), str(device), where),
        )
        return made

    def pad(self, tensor: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        made = self.inner.pad(tensor, widths)
        label = self._made("pad", made)
        where = self.where()
        self.note(
            ("pad", label, self.label(tensor), tuple(widths), where),
            ("pad", tuple(widths), where),
        )
        return made

    def stack(self, tensors: tuple[torch.Tensor, ...], dim: int = 0) -> torch.Tensor:
        made = self.inner.stack(tensors, dim=dim)
        label = self._made("stack", made)
        where = self.where()
        self.note(
            ("stack", label, tuple(self.label(t) for t in tensors), dim, where),
            ("stack", len(tensors), dim, where),
        )
        return made

    def broadcast(self, tensor: torch.Tensor, src: int, group: object) -> object:
        done = self.inner.broadcast(tensor, src=src, group=group)
        if self.deliver is not None:
            self.deliver(len(self.sent), tensor)
        if isinstance(tensor, torch.Tensor):
            self.sent.append(tensor.clone())
        where = self.where()
        self.note(
            (
                "broadcast",
                self.label(tensor),
                tuple(tensor.shape),
                str(tensor.dtype),
                src,
                group is self.group,
                where,
            ),
            ("broadcast", src, where),
        )
        return done

    def h2d(self, array: npt.NDArray[np.int32], device: torch.device) -> torch.Tensor:
        made = self.inner.h2d(array, device)
        label = self._made("h2d", made)
        values = tuple(array.tolist())
        where = self.where()
        self.note(
            ("h2d", label, values, str(array.dtype), str(device), where),
            ("h2d", values, str(array.dtype), str(device), where),
        )
        return made

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        self.inner.record_stream(tensor, stream)
        named = cast(_Stream, stream).name
        where = self.where()
        self.note(
            ("record_stream", self.label(tensor), named, where), ("record_stream", named, where)
        )

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        self.note(("new_stream", str(device)))
        return cast(torch.cuda.Stream, _Stream("broadcast", self))

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        self.note(("current_stream", str(device)))
        return cast(torch.cuda.Stream, _Stream("main", self))

    def stream(self, stream: torch.cuda.Stream) -> _StreamContext:
        return _StreamContext(self, cast(_Stream, stream))

    def calls(self) -> DeviceCalls:
        return DeviceCalls(
            empty=self.empty,
            as_tensor=self.as_tensor,
            pad=self.pad,
            stack=self.stack,
            broadcast=self.broadcast,
            h2d=self.h2d,
            record_stream=self.record_stream,
            new_stream=self.new_stream,
            current_stream=self.current_stream,
            stream=self.stream,
        )

    def adopt(self, relay: SeedRelay) -> None:
        """Record the device calls of a relay someone else built (its streams too)."""
        relay.calls = self.calls()
        relay.main_stream = cast(torch.cuda.Stream, _Stream("main", self))
        relay.broadcast_stream = cast(torch.cuda.Stream, _Stream("broadcast", self))

    def take(self) -> list[Entry]:
        """The calls logged since the last take."""
        taken = self.log[self._taken :]
        self._taken = len(self.log)
        return taken

    _taken = 0


def _wire(k: int, tensor: torch.Tensor) -> None:
    """The k-th broadcast's payload, as a sender would have sent it: 1000 (k + 1) + i."""
    values = torch.arange(tensor.numel(), dtype=torch.int64) + 1000 * (k + 1)
    tensor.copy_(values.reshape(*tensor.shape).to(tensor.dtype))


def _batch(
    slots: tuple[int, ...],
    computed: tuple[int, ...],
    scheduled: tuple[int, ...],
    prefill: tuple[int, ...],
) -> SeedBatch:
    idx_np = _i32(*slots)
    return SeedBatch(
        len(slots),
        torch.from_numpy(idx_np.copy()),
        idx_np,
        _i32(*computed),
        _i32(*scheduled),
        _i32(*prefill),
    )


def _decode(*slots: int) -> SeedBatch:
    """A decode batch: every row produces its sampled token."""
    n = len(slots)
    return _batch(slots, (10,) * n, (1,) * n, (4,) * n)


def _relay_group(groups: dict[Communicator, dist.ProcessGroup]) -> dist.ProcessGroup:
    return groups[Communicator.PP_RELAY]


# ---- 1. SeedRelay makes the seed's calls, call for call -------------------------------------

# The seed's receive (000, `PPHandler.receive`), for n rows at spec 2: the side stream waits
# on main; sampled tokens [n, 3] int64 and the counts [2, n] int32 are allocated and
# received, then the drafts [n, 2] int64; an event is recorded on the side stream; after
# the `with`, the three buffers are recorded on main.


def _seed_receive_spec2(n: int, first: int, event: str) -> list[Entry]:
    t, c, d = (f"empty{first + i}" for i in range(3))
    b = "broadcast"
    return [
        ("enter", b),
        ("wait_stream", b, "main"),
        ("empty", t, (n, 3), "torch.int64", "cpu", b),
        ("empty", c, (2, n), "torch.int32", "cpu", b),
        ("broadcast", t, (n, 3), "torch.int64", 0, True, b),
        ("broadcast", c, (2, n), "torch.int32", 0, True, b),
        ("empty", d, (n, 2), "torch.int64", "cpu", b),
        ("broadcast", d, (n, 2), "torch.int64", 0, True, b),
        ("record_event", b, event),
        ("exit", b),
        ("record_stream", t, "main", "main"),
        ("record_stream", c, "main", "main"),
        ("record_stream", d, "main", "main"),
    ]


def test_a_speculating_receiver_makes_the_seeds_calls_in_order(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """A receiver at spec 2, pp 2, over seven steps (consume, frees, receive each):
    step 0 posts 3 rows; step 1 posts 2 rows, one a non-final prefill chunk, after slot
    5 (a row of step 0) is freed; step 2 consumes step 0 with slot 5 dropped (the h2d of
    the -1 mapping, the wait, `as_tensor` of the keep mask, the h2d of the kept slots)
    and posts nothing (no row samples: `need_sampled_mask` None); step 3 consumes step
    1 with the prefill row dropped; step 4 consumes step 2's empty entry (no call) and
    frees both slots of step 3's batch; step 5 consumes step 3: every row excluded, so
    None with no call at all; step 6 consumes step 4 with nothing dropped (only the
    wait; the drafts scattered by the batch's own device mapping)."""
    group = _relay_group(groups)
    rec = Recorder(host_calls(), group=group, deliver=_wire)
    relay = SeedRelay(
        calls=rec.calls(),
        is_last_rank=False,
        last_rank=0,
        ring_depth=2,
        max_num_reqs=8,
        num_speculative_steps=2,
        device=CPU,
        group=group,
    )
    assert rec.take() == [("current_stream", "cpu"), ("new_stream", "cpu")]
    table = torch.full((8, 2), -1, dtype=torch.int64)
    batches = [
        _decode(5, 1, 6),
        _batch((2, 7), (0, 0), (3, 2), (3, 8)),  # row 1: a non-final prefill chunk
        _batch((3,), (0,), (2,), (5,)),  # no row samples
        _decode(0, 4),
        _decode(1),
        _decode(6, 2),
    ]
    for step, b in enumerate(batches):
        rec.name(b.idx_mapping, f"idx@{step}")
    frees = {1: (5,), 4: (0, 4)}
    outs: list[dict[str, torch.Tensor] | None] = []
    posted: list[bool] = []
    calls: list[list[Entry]] = []
    tables: list[list[list[int]]] = []
    for step in range(7):
        outs.append(relay.get_prev_sampled_outputs(table))
        for slot in frees.get(step, ()):
            relay.on_req_idx_freed(slot)
        if step < len(batches):
            posted.append(relay.receive(batches[step]))
        calls.append(rec.take())
        tables.append(table.tolist())

    main = "main"
    assert calls[0] == _seed_receive_spec2(3, 0, "ev0")
    assert calls[1] == _seed_receive_spec2(2, 3, "ev1")
    assert calls[2] == [
        ("h2d", "h2d0", (-1, 1, 6), "int32", "cpu", main),
        ("wait_event", main, "ev0"),
        ("as_tensor", "as_tensor0", (False, True, True), "bool", "cpu", main),
        ("h2d", "h2d1", (1, 6), "int32", "cpu", main),
    ]
    assert calls[3] == [
        ("h2d", "h2d2", (2, -1), "int32", "cpu", main),
        ("wait_event", main, "ev1"),
        ("as_tensor", "as_tensor1", (True, False), "bool", "cpu", main),
        ("h2d", "h2d3", (2,), "int32", "cpu", main),
        *_seed_receive_spec2(2, 6, "ev2"),
    ]
    assert calls[4] == _seed_receive_spec2(1, 9, "ev3")
    assert calls[5] == _seed_receive_spec2(2, 12, "ev4")
    assert calls[6] == [("wait_event", main, "ev3")]
    assert posted == [True, False, False, True, True, True]

    # What each consume hands back: the received buffers, the counts' two rows, the mapping.
    assert [o is None for o in outs] == [True, True, False, False, True, True, False]
    first, second, last = cast(list[dict[str, torch.Tensor]], [outs[2], outs[3], outs[6]])
    assert list(first) == ["sampled_tokens", "num_sampled", "num_rejected", "idx_mapping"]
    assert rec.label(first["sampled_tokens"]) == "empty0"
    assert first["sampled_tokens"].tolist() == [
        [1000 + 3 * r + c for c in range(3)] for r in (0, 1, 2)
    ]
    assert first["num_sampled"].tolist() == [2000, 2001, 2002]
    assert first["num_rejected"].tolist() == [2003, 2004, 2005]
    assert rec.label(first["idx_mapping"]) == "h2d0"
    assert first["idx_mapping"].tolist() == [-1, 1, 6]
    assert rec.label(second["sampled_tokens"]) == "empty3"
    assert second["idx_mapping"].tolist() == [2, -1]
    assert rec.label(last["idx_mapping"]) == "idx@4"  # nothing dropped: the batch's own
    assert last["num_sampled"].tolist() == [11000]
    # The draft table: kept rows of each consumed entry's drafts, by slot.
    untouched = [-1, -1]
    assert tables[1] == [untouched] * 8
    assert tables[2][1] == [3002, 3003]
    assert tables[2][6] == [3004, 3005]
    assert tables[2][5] == untouched  # freed: dropped
    assert tables[3][2] == [6000, 6001]
    assert tables[3][7] == untouched
    assert tables[5] == tables[3]  # an empty entry and an all-excluded entry write nothing
    assert tables[6][1] == [12000, 12001]


def test_a_receiver_without_speculation_consumes_ring_depth_steps_later(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """pp 3, spec 0: the ring is pre-seeded with three Nones, so the first three
    consumes make no call; step 3 consumes step 0 (only the wait), step 5 consumes step 2
    with its prefill row dropped (one h2d: no drafts, so no keep mask). Each receive
    posts two broadcasts and records two buffers on main."""
    group = _relay_group(groups)
    rec = Recorder(host_calls(), group=group, deliver=_wire)
    relay = SeedRelay(
        calls=rec.calls(),
        is_last_rank=False,
        last_rank=0,
        ring_depth=3,
        max_num_reqs=8,
        num_speculative_steps=0,
        device=CPU,
        group=group,
    )
    rec.take()
    batches = [_decode(1, 2), _decode(3), _batch((4, 5), (0, 9), (2, 1), (7, 4)), _decode(6)]
    for step, b in enumerate(batches):
        rec.name(b.idx_mapping, f"idx@{step}")
    side = "broadcast"

    def receive(n: int, k: int, event: str) -> list[Entry]:
        return [
            ("enter", side),
            ("wait_stream", side, "main"),
            ("empty", f"empty{k}", (n, 1), "torch.int64", "cpu", side),
            ("empty", f"empty{k + 1}", (2, n), "torch.int32", "cpu", side),
            ("broadcast", f"empty{k}", (n, 1), "torch.int64", 0, True, side),
            ("broadcast", f"empty{k + 1}", (2, n), "torch.int32", 0, True, side),
            ("record_event", side, event),
            ("exit", side),
            ("record_stream", f"empty{k}", "main", "main"),
            ("record_stream", f"empty{k + 1}", "main", "main"),
        ]

    outs = []
    calls = []
    for step in range(6):
        outs.append(relay.get_prev_sampled_outputs(None))
        if step < len(batches):
            relay.receive(batches[step])
        calls.append(rec.take())
    assert calls[:4] == [
        receive(2, 0, "ev0"),
        receive(1, 2, "ev1"),
        receive(2, 4, "ev2"),
        [("wait_event", "main", "ev0"), *receive(1, 6, "ev3")],
    ]
    assert calls[4] == [("wait_event", "main", "ev1")]
    assert calls[5] == [
        ("h2d", "h2d0", (-1, 5), "int32", "cpu", "main"),
        ("wait_event", "main", "ev2"),
    ]
    assert [o is None for o in outs] == [True, True, True, False, False, False]
    third = cast(dict[str, torch.Tensor], outs[3])
    assert rec.label(third["idx_mapping"]) == "idx@0"
    assert third["sampled_tokens"].tolist() == [[1000], [1001]]
    assert cast(dict[str, torch.Tensor], outs[5])["idx_mapping"].tolist() == [-1, 5]


def test_a_speculating_sender_makes_the_seeds_calls_in_order(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """The last rank at spec 2 (000, `broadcast` then `broadcast_drafts`): on the side
    stream, after it waits on main, `F.pad` of the tokens to width 3 and its broadcast,
    `torch.stack` of the counts and its broadcast, the three inputs recorded on the side
    stream inside the `with`; then the drafts: a wait, the idx_mapping recorded on the
    side stream, the broadcast of the batch's rows of the table. A plain-sampler step
    ([n, 1] tokens) pads by 2; a step where no row samples makes no call at all; int32
    tokens trip the seed's dtype assert (after its mask check)."""
    group = _relay_group(groups)
    rec = Recorder(host_calls(), group=group)
    relay = SeedRelay(
        calls=rec.calls(),
        is_last_rank=True,
        last_rank=0,
        ring_depth=2,
        max_num_reqs=6,
        num_speculative_steps=2,
        device=CPU,
        group=group,
    )
    rec.take()
    table = torch.arange(12, dtype=torch.int64).reshape(6, 2) + 500
    batches = [_decode(3, 0), _decode(5, 1, 2), _batch((4,), (0,), (1,), (9,))]
    widths = [3, 1, 3]
    sent_inputs = []
    for step, (b, width) in enumerate(zip(batches, widths, strict=True)):
        n = b.num_reqs
        tokens = torch.arange(n * width, dtype=torch.int64).reshape(n, width) + 100 * (step + 1)
        ns = torch.arange(n, dtype=torch.int32) + 10
        nr = torch.arange(n, dtype=torch.int32) + 20
        for tensor, what in ((tokens, "tokens"), (ns, "ns"), (nr, "nr"), (b.idx_mapping, "idx")):
            rec.name(tensor, f"{what}@{step}")
        sent_inputs.append((tokens, ns, nr))
        relay.broadcast(tokens, ns, nr, b)
        relay.broadcast_drafts(table, b)
    b_ = "broadcast"

    def send(step: int, n: int, width: int, k: int) -> list[Entry]:
        return [
            ("enter", b_),
            ("wait_stream", b_, "main"),
            ("pad", f"pad{k}", f"tokens@{step}", (0, 3 - width), b_),
            ("broadcast", f"pad{k}", (n, 3), "torch.int64", 0, True, b_),
            ("stack", f"stack{k}", (f"ns@{step}", f"nr@{step}"), 0, b_),
            ("broadcast", f"stack{k}", (2, n), "torch.int32", 0, True, b_),
            ("record_stream", f"tokens@{step}", b_, b_),
            ("record_stream", f"ns@{step}", b_, b_),
            ("record_stream", f"nr@{step}", b_, b_),
            ("exit", b_),
            ("enter", b_),
            ("wait_stream", b_, "main"),
            ("record_stream", f"idx@{step}", b_, b_),
            ("broadcast", "?", (n, 2), "torch.int64", 0, True, b_),
            ("exit", b_),
        ]

    assert rec.take() == send(0, 2, 3, 0) + send(1, 3, 1, 1)
    # What went on the wire: the padded tokens, the stacked counts, the table's rows.
    tokens0, ns0, nr0 = sent_inputs[0]
    tokens1, ns1, nr1 = sent_inputs[1]
    assert [s.tolist() for s in rec.sent] == [
        tokens0.tolist(),
        [ns0.tolist(), nr0.tolist()],
        [[506, 507], [500, 501]],
        [[row[0], 0, 0] for row in tokens1.tolist()],
        [ns1.tolist(), nr1.tolist()],
        [[510, 511], [502, 503], [504, 505]],
    ]
    b = batches[0]
    ns, nr = sent_inputs[0][1:]
    relay.broadcast(torch.zeros(1, 3, dtype=torch.int32), ns, nr, batches[2])  # mask None first
    with pytest.raises(AssertionError):
        relay.broadcast(torch.zeros(2, 3, dtype=torch.int32), ns, nr, b)


def test_a_sender_without_speculation_broadcasts_tokens_and_counts_only(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    """spec 0: the tokens keep width 1 (a pad by 0), then the counts; nothing else."""
    group = _relay_group(groups)
    rec = Recorder(host_calls(), group=group)
    relay = SeedRelay(
        calls=rec.calls(),
        is_last_rank=True,
        last_rank=0,
        ring_depth=2,
        max_num_reqs=4,
        num_speculative_steps=0,
        device=CPU,
        group=group,
    )
    rec.take()
    b = _decode(2, 0, 3)
    tokens = torch.tensor([[7], [8], [9]], dtype=torch.int64)
    ns = torch.ones(3, dtype=torch.int32)
    nr = torch.zeros(3, dtype=torch.int32)
    for tensor, what in ((tokens, "tokens"), (ns, "ns"), (nr, "nr")):
        rec.name(tensor, what)
    relay.broadcast(tokens, ns, nr, b)
    x = "broadcast"
    assert rec.take() == [
        ("enter", x),
        ("wait_stream", x, "main"),
        ("pad", "pad0", "tokens", (0, 0), x),
        ("broadcast", "pad0", (3, 1), "torch.int64", 0, True, x),
        ("stack", "stack0", ("ns", "nr"), 0, x),
        ("broadcast", "stack0", (2, 3), "torch.int32", 0, True, x),
        ("record_stream", "tokens", x, x),
        ("record_stream", "ns", x, x),
        ("record_stream", "nr", x, x),
        ("exit", x),
    ]
    assert [s.tolist() for s in rec.sent] == [[[7], [8], [9]], [[1, 1, 1], [0, 0, 0]]]


class _Staged:
    """What `torch.from_numpy` returns while the CUDA h2d is checked: notes its calls."""

    def __init__(self, seen: list[object]) -> None:
        self.seen = seen

    def pin_memory(self) -> _Staged:
        self.seen.append("pin_memory")
        return self

    def to(self, device: object, non_blocking: bool = False) -> _Staged:
        self.seen.append(("to", device, non_blocking))
        return self


def test_the_cuda_flavour_makes_the_seeds_own_torch_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 figures' `seed` (`cuda_calls`) calls the functions 000 calls, and its
    `async_tensor_h2d` stages the array in pinned memory and copies it without blocking
    (the seeds' README), in that order."""
    calls = cuda_calls()
    assert calls.empty is torch.empty
    assert calls.as_tensor is torch.as_tensor
    assert calls.pad is F.pad
    assert calls.stack is torch.stack
    assert calls.broadcast is dist.broadcast
    assert calls.record_stream is torch.Tensor.record_stream
    assert calls.new_stream is torch.cuda.Stream
    assert calls.current_stream is torch.cuda.current_stream
    assert calls.stream is torch.cuda.stream
    seen: list[object] = []
    array = _i32(4, -1)

    def from_numpy(given: object) -> _Staged:
        seen.append(("from_numpy", given is array))
        return _Staged(seen)

    monkeypatch.setattr(torch, "from_numpy", from_numpy)
    device = torch.device("cuda", 0)
    calls.h2d(array, device)
    assert seen == [("from_numpy", True), "pin_memory", ("to", device, True)]


# ---- 2. the seed and purepp consume the same tokens on the same schedule ---------------------


def _payload(step: int, n: int, spec: int) -> tuple[torch.Tensor, ...]:
    """The tokens, counts and drafts the last rank sends for `step` (distinct per step)."""
    rows = torch.arange(n, dtype=torch.int64).reshape(n, 1)
    tokens = step * 10_000 + rows * 10 + torch.arange(spec + 1, dtype=torch.int64) + 1
    ns = (step * 100 + torch.arange(n, dtype=torch.int32)).to(torch.int32)
    nr = ns + 50
    drafts = -(step * 10_000 + rows * 10 + torch.arange(spec, dtype=torch.int64) + 1)
    return tokens, ns, nr, drafts


def _deliver_seed(relay: SeedRelay, step: int, spec: int) -> None:
    entry = relay.queue[-1] if relay.queue else None
    if entry is None:
        return
    tokens, ns, nr, drafts = _payload(step, entry.sampled_tokens.shape[0], spec)
    entry.sampled_tokens.copy_(tokens)
    entry.num_sampled.copy_(ns)
    entry.num_rejected.copy_(nr)
    if entry.draft_tokens is not None:
        entry.draft_tokens.copy_(drafts)


def _deliver_purepp(relay: PureppRelay, step: int, spec: int) -> None:
    entry = relay.state.ring[-1] if relay.state.ring else None
    env = relay.env
    if entry is None or env is None:
        return
    tokens, ns, nr, drafts = _payload(step, entry.idx_mapping_np.shape[0], spec)
    env.tensor(entry.sampled_tokens).copy_(tokens)
    env.tensor(entry.num_sampled).copy_(ns)
    env.tensor(entry.num_rejected).copy_(nr)
    if entry.draft_tokens is not None:
        env.tensor(entry.draft_tokens).copy_(drafts)


Outputs = tuple[list[Any], ...] | None


def _plain_outputs(out: dict[str, torch.Tensor] | None) -> Outputs:
    if out is None:
        return None
    keys = ("sampled_tokens", "num_sampled", "num_rejected", "idx_mapping")
    return tuple(out[k].tolist() for k in keys)


def _capture_consumes(obj: object, method: str, into: list[Outputs]) -> None:
    """Wrap `obj.method` (a consume) so every output it hands back is noted, as values."""
    inner = getattr(obj, method)

    def noted(*args: Any) -> Any:
        out = inner(*args)
        into.append(_plain_outputs(out))
        return out

    setattr(obj, method, noted)


@pytest.mark.parametrize(("spec", "pp"), [(0, 2), (3, 2), (3, 3)])
def test_the_harness_receivers_seed_and_eager_consume_the_same_tokens(
    groups: dict[Communicator, dist.ProcessGroup], spec: int, pp: int
) -> None:
    """relay_host_cost's own `seed` and `eager` contenders (`build_contenders` from one
    `build_inputs`), stepped together over two cycles with the sender's payload written
    into each newly received entry: every consume hands back the same tokens, counts
    and mapping (-1 for rows freed since), and the draft table is the same after every
    step."""
    case = Case(role="receiver", rows=8, spec=spec)
    slots = 16
    inputs = build_inputs(case, slots, CPU)
    contenders = {
        c.name: c
        for c in build_contenders(
            case, inputs, pp=pp, slots=slots, device=CPU, groups=groups, modes={"eager": ""}
        )
    }
    seed, eager = contenders["seed"], contenders["eager"]
    seed_relay: SeedRelay = _closure(seed.run, "relay")
    seed_table: torch.Tensor | None = _closure(seed.run, "table")
    purepp: PureppRelay = _closure(eager.run, "relay")
    env = purepp.env
    assert env is not None
    purepp_table = env.tensor(purepp.inputs.draft_table) if spec else None
    seen_seed: list[Outputs] = []
    seen_purepp: list[Outputs] = []
    _capture_consumes(seed_relay, "get_prev_sampled_outputs", seen_seed)
    _capture_consumes(purepp, "consume", seen_purepp)
    dropped = 0
    for step in range(2 * CYCLE):
        seed.advance(1)
        eager.advance(1)
        _deliver_seed(seed_relay, step, spec)
        _deliver_purepp(purepp, step, spec)
        assert seen_seed[-1] == seen_purepp[-1], step
        out = seen_seed[-1]
        dropped += out is not None and -1 in out[3]
        if seed_table is not None and purepp_table is not None:
            assert torch.equal(seed_table, purepp_table), step
    assert sum(o is not None for o in seen_seed) == 2 * CYCLE - pp
    assert dropped > 0  # the schedule's frees did drop rows: the filtered path was compared


@pytest.mark.parametrize("spec", [0, 3])
def test_the_harness_senders_seed_and_eager_send_the_same_bytes(
    groups: dict[Communicator, dist.ProcessGroup], spec: int
) -> None:
    """The harness's `seed` and `eager` senders over two cycles (plain-sampler steps
    included) broadcast the same tensors, in the same order, step by step."""
    case = Case(role="sender", rows=8, spec=spec)
    slots = 16
    inputs = build_inputs(case, slots, CPU)
    contenders = {
        c.name: c
        for c in build_contenders(
            case, inputs, pp=2, slots=slots, device=CPU, groups=groups, modes={"eager": ""}
        )
    }
    seed, eager = contenders["seed"], contenders["eager"]
    seed_relay: SeedRelay = _closure(seed.run, "relay")
    seed_table: torch.Tensor | None = _closure(seed.run, "table")
    rec = Recorder(seed_relay.calls, group=seed_relay.broadcast_group)
    rec.adopt(seed_relay)
    purepp: PureppRelay = _closure(eager.run, "relay")
    env = purepp.env
    assert env is not None
    if seed_table is not None:  # the same table contents on both sides
        seed_table.copy_(torch.arange(seed_table.numel()).reshape(*seed_table.shape))
        env.tensor(purepp.inputs.draft_table).copy_(seed_table)
    purepp_sent: list[torch.Tensor] = []
    perform = env.perform

    def performed(effects: Any) -> None:
        effects = tuple(effects)
        perform(effects)
        purepp_sent.extend(
            env.tensor(e.buffer).clone() for e in effects if isinstance(e, Broadcast)
        )

    setattr(env, "perform", performed)  # noqa: B010  # an instance's method, for this test
    for step in range(2 * CYCLE):
        seed.advance(1)
        eager.advance(1)
        assert len(rec.sent) == len(purepp_sent), step
    assert len(rec.sent) == 2 * CYCLE * (3 if spec else 2)
    for ours, theirs in zip(rec.sent, purepp_sent, strict=True):
        assert ours.dtype == theirs.dtype
        assert torch.equal(ours, theirs)


def _schedule(seed: int, steps: int, slots: int) -> Iterator[tuple[tuple[int, ...], I32, I32]]:
    """Per step: the slots freed before the receive, the batch's slots, its need mask."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        freed = tuple(int(s) for s in rng.choice(slots, size=int(rng.integers(0, 3))))
        n = int(rng.integers(1, 6))
        idx = rng.permutation(slots)[:n].astype(np.int32)
        kind = rng.integers(0, 4)
        if kind == 0:
            need = np.zeros(n, dtype=np.int32)  # nothing samples: no broadcast
        elif kind == 1:
            need = rng.integers(0, 2, size=n).astype(np.int32)  # prefill chunks mixed in
        else:
            need = np.ones(n, dtype=np.int32)
        yield freed, idx, need


@pytest.mark.parametrize(("pp", "spec", "seed"), [(2, 0, 1), (2, 2, 2), (3, 2, 3), (4, 1, 4)])
def test_the_seed_and_purepp_consume_alike_with_prefill_chunks_skips_and_frees(
    groups: dict[Communicator, dist.ProcessGroup], pp: int, spec: int, seed: int
) -> None:
    """The harness never schedules a non-final prefill chunk or a step with no sampled
    row; here SeedRelay (host calls) and purepp (eager) follow one random schedule that
    does, with frees of slots in flight, and consume the same values every step."""
    slots = 10
    group = _relay_group(groups)
    seed_relay = SeedRelay(
        calls=host_calls(),
        is_last_rank=False,
        last_rank=0,
        ring_depth=pp,
        max_num_reqs=slots,
        num_speculative_steps=spec,
        device=CPU,
        group=group,
    )
    env, _ = make_interpreter("eager", CPU, groups, pp)
    assert env is not None
    table_seed = torch.full((slots, spec), -7, dtype=torch.int64) if spec else None
    table_purepp = table_seed.clone() if table_seed is not None else None
    purepp = PureppRelay(
        role="receiver", pp=pp, slots=slots, spec=spec, env=env, draft_table=table_purepp
    )
    skipped = filtered = 0
    for step, (freed, idx, need) in enumerate(_schedule(seed, 60, slots)):
        ours = _plain_outputs(seed_relay.get_prev_sampled_outputs(table_seed))
        theirs = _plain_outputs(purepp.consume())
        assert ours == theirs, step
        filtered += ours is not None and -1 in ours[3]
        for slot in freed:
            seed_relay.on_req_idx_freed(slot)
        purepp.free(freed)
        n = idx.shape[0]
        computed = np.where(need == 1, 10, 0).astype(np.int32)
        scheduled = np.ones(n, dtype=np.int32)
        prefill = np.full(n, 4, dtype=np.int32)
        device_idx = torch.from_numpy(idx.copy())
        posted = seed_relay.receive(SeedBatch(n, device_idx, idx, computed, scheduled, prefill))
        facts = BatchFacts(
            idx_mapping=idx,
            num_computed_tokens=computed,
            num_scheduled_tokens=scheduled,
            prefill_len=prefill,
        )
        purepp.receive(facts, device_idx)
        assert posted == facts.all_sampled
        skipped += facts.sampled_mask is None
        _deliver_seed(seed_relay, step, spec)
        _deliver_purepp(purepp, step, spec)
        purepp.end()
        if table_seed is not None and table_purepp is not None:
            assert torch.equal(table_seed, table_purepp), step
    assert skipped
    assert filtered


# ---- 3. the no-op flavour times the seed's host logic, all of it, and nothing else -----------


def _torch_calls_in(run: Callable[[], None]) -> list[str]:
    """The torch functions and tensor methods `run` calls (a TorchFunctionMode)."""
    seen: list[str] = []

    def torch_function(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(getattr(func, "__qualname__", repr(func)))
        return func(*args, **(kwargs or {}))

    mode = type("Seen", (overrides.TorchFunctionMode,), {"__torch_function__": torch_function})
    with mode():
        run()
    return seen


def _refuse(*args: object, **kwargs: object) -> Any:
    raise AssertionError("a real torch call in the no-op flavour")


@pytest.mark.parametrize("role", ["receiver", "sender"])
@pytest.mark.parametrize("spec", [0, 3])
def test_the_harness_seed_noop_contender_calls_no_torch(
    groups: dict[Communicator, dist.ProcessGroup],
    monkeypatch: pytest.MonkeyPatch,
    role: str,
    spec: int,
) -> None:
    """relay_host_cost's `seed_noop` contender, over two cycles of its own schedule
    (frees, filtered consumes, plain-sampler steps), calls no torch function, no tensor
    method, no `torch.from_numpy` and no `dist.broadcast`: its time is host logic."""
    case = Case(role="receiver" if role == "receiver" else "sender", rows=8, spec=spec)
    inputs = build_inputs(case, 16, CPU)  # real tensors, made before anything is timed
    # Patched before the flavours are built, so a flavour that kept a real call holds it.
    monkeypatch.setattr(torch, "from_numpy", _refuse)
    monkeypatch.setattr(dist, "broadcast", _refuse)
    contenders = build_contenders(case, inputs, pp=2, slots=16, device=CPU, groups=groups, modes={})
    noop = next(c for c in contenders if c.name == "seed_noop")
    assert _torch_calls_in(lambda: noop.advance(2 * CYCLE)) == []


def _normal_state(relay: SeedRelay) -> list[object]:
    """The host side of a relay's state: generations and each ring entry's host arrays."""
    entries: list[object] = [relay.req_idx_gen_np.tolist(), len(relay.queue)]
    for e in relay.queue:
        if e is None:
            entries.append(None)
        else:
            arrays = (e.idx_mapping_np, e.need_sampled_mask, e.gen_at_receive_np)
            entries.append(tuple(a.tolist() for a in arrays))
    return entries


@pytest.mark.parametrize("role", ["receiver", "sender"])
@pytest.mark.parametrize("spec", [0, 3])
def test_the_noop_flavour_runs_every_host_step_the_real_one_runs(
    groups: dict[Communicator, dist.ProcessGroup], role: str, spec: int
) -> None:
    """`seed_runner` with noop=True (placeholders) and noop=False (real CPU tensors) on
    the same inputs make the same device calls with the same host-decided arguments
    (shapes asked for, h2d'd arrays, keep masks, pad widths, sources, streams), and
    leave the same host state (generations, ring entries' arrays) after two cycles.
    The harness builds both relays alike (ring depth, spec, slots, last rank) and each
    with its flavour (checked from `build_contenders`' own relays)."""
    from benchmarks.relay_host_cost import seed_runner

    case = Case(role="receiver" if role == "receiver" else "sender", rows=8, spec=spec)
    slots = 16
    inputs = build_inputs(case, slots, CPU)
    built = {
        c.name: c
        for c in build_contenders(
            case, inputs, pp=2, slots=slots, device=CPU, groups=groups, modes={}
        )
    }
    real: SeedRelay = _closure(built["seed"].run, "relay")
    noop: SeedRelay = _closure(built["seed_noop"].run, "relay")
    assert real.calls == host_calls()
    assert noop.calls == noop_calls()
    assert real.broadcast_group is _relay_group(groups)
    for made in (real, noop):
        assert (made.is_last_rank, made.last_rank, made.max_sample_len) == (
            role == "sender",
            0,
            spec + 1,
        )
        assert list(made.queue) == ([] if role == "sender" else [None, None])
        assert made.req_idx_gen_np.shape == (slots,)

    def relay(calls: DeviceCalls, group: object) -> SeedRelay:
        return SeedRelay(
            calls=calls,
            is_last_rank=role == "sender",
            last_rank=0,
            ring_depth=2,
            max_num_reqs=slots,
            num_speculative_steps=spec,
            device=CPU,
            group=cast(dist.ProcessGroup | None, group),
        )

    group = _relay_group(groups)
    rec_real, rec_noop = Recorder(host_calls(), group=group), Recorder(noop_calls())
    relay_real, relay_noop = relay(rec_real.calls(), group), relay(rec_noop.calls(), None)
    table = torch.zeros((slots, spec), dtype=torch.int64) if spec else None
    noop_table = _closure(built["seed_noop"].run, "table")
    run_real = seed_runner(case, inputs, relay_real, table, noop=False)
    run_noop = seed_runner(case, inputs, relay_noop, noop_table, noop=True)
    for step in range(2 * CYCLE):
        run_real(step, 1)
        run_noop(step, 1)
        assert rec_noop.plain == rec_real.plain, step
        assert _normal_state(relay_noop) == _normal_state(relay_real), step
    assert any(e[0] == "h2d" for e in rec_real.plain) == (role == "receiver")


# ---- 4. the DP baselines decide as 004 does, and as purepp's finish does ----------------------

NONE, FULL = CUDAGraphMode.NONE, CUDAGraphMode.FULL
Decision = tuple[BatchExecutionDescriptor, tuple[list[int], int | None, bool, int] | None]


def _desired(b: RankBatch, dispatcher: Any = None) -> BatchExecutionDescriptor:
    """004 `dispatch_cg_and_sync_dp`: eager when `need_eager`, else the manager's pick."""
    if b.need_eager:
        return BatchExecutionDescriptor(
            cg_mode=NONE,
            num_tokens=b.num_tokens,
            num_reqs=b.num_reqs,
            num_active_loras=b.num_active_loras,
        )
    got: BatchExecutionDescriptor = (dispatcher or dpa.DISPATCHER).dispatch(
        b.num_reqs,
        b.num_tokens,
        b.uniform_token_count,
        num_active_loras=b.num_active_loras,
        max_query_len=b.max_query_len,
    )
    return got


def _column(b: RankBatch, desired: BatchExecutionDescriptor) -> list[int]:
    """004: tensor[0..4][dp_rank] = num_tokens, cg_mode, uniform or 0, max_query_len or -1,
    num_reqs."""
    return [
        b.num_tokens,
        desired.cg_mode.value,
        b.uniform_token_count or 0,
        b.max_query_len or -1,
        b.num_reqs,
    ]


def _reduced(batches: list[RankBatch], dispatcher: Any = None) -> I32:
    table = np.zeros((5, len(batches)), dtype=np.int32)
    for rank, b in enumerate(batches):
        table[:, rank] = _column(b, _desired(b, dispatcher))
    return table


def _seed_004(batches: list[RankBatch], rank: int, table: I32, dispatcher: Any = None) -> Decision:
    """004 `sync_cudagraph_and_dp_padding` after its all-reduce, over plain lists."""
    b = batches[rank]
    desired = _desired(b, dispatcher)
    tokens, modes, uniforms, query_lens, reqs = (list(map(int, row)) for row in table)
    uniform: int | None = uniforms[0]
    if uniform == 0 or any(u != uniform for u in uniforms):
        uniform = None
    if all(t == 0 for t in tokens):
        return BatchExecutionDescriptor(cg_mode=NONE, num_tokens=0, num_reqs=0), None
    if CUDAGraphMode(min(modes)) == NONE:
        eager = BatchExecutionDescriptor(
            cg_mode=NONE,
            num_tokens=b.num_tokens,
            num_reqs=b.num_reqs,
            num_active_loras=desired.num_active_loras,
        )
        return eager, (tokens, uniform, True, max(reqs))
    query_len = max(query_lens) if all(q != -1 for q in query_lens) else None
    graph: BatchExecutionDescriptor = (dispatcher or dpa.DISPATCHER).dispatch(
        b.num_reqs,
        max(tokens),
        uniform,
        num_active_loras=b.num_active_loras,
        max_query_len=query_len,
    )
    padded = [graph.num_tokens] * len(tokens)
    agreed_reqs = (
        graph.num_reqs if graph.cg_mode == FULL and graph.num_reqs is not None else max(reqs)
    )
    return graph, (padded, uniform, False, agreed_reqs)


def _plain_decision(descriptor: BatchExecutionDescriptor, sync: Any) -> Decision:
    if sync is None:
        return descriptor, None
    tokens = sync.num_tokens_across_dp.tolist()
    return descriptor, (tokens, sync.uniform_token_count, sync.eager, sync.num_reqs)


# Varlen decode graphs: chosen by the query-length bound (FULL, 8 requests padded) when
# every rank sets one, PIECEWISE when one does not.
VARLEN = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=256,
    num_speculative_tokens=1,
    varlen_decode=True,
)


# LoRA graphs for 0, 2 and 4 adapters: 1 active adapter runs the 2-adapter graph, so a
# descriptor's count (the effective one) differs from the batch's.
LORA = CudaGraphDispatcher(
    capture_sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    capture_mode=CaptureMode.FULL_AND_PIECEWISE,
    max_num_reqs=256,
    num_speculative_tokens=1,
    lora_capture_cases=(0, 2, 4),
)


def _tables(dp: int) -> dict[str, tuple[Any, list[RankBatch]]]:
    """The benchmark's two branches and the other shapes 004 distinguishes, at `dp`."""
    decode = RankBatch(num_reqs=4, num_tokens=8, uniform_token_count=2, max_query_len=2)
    idle = RankBatch(num_reqs=0, num_tokens=0)
    spread = [
        RankBatch(num_reqs=1 + r % 3, num_tokens=3 + r % 7, max_query_len=1 + r % 5)
        for r in range(dp)
    ]
    mixed_uniform = [decode] * dp
    mixed_uniform[-1] = RankBatch(num_reqs=4, num_tokens=8, max_query_len=2)
    # FULL uniform decode of 3 requests pads to the 8-token graph of 4 requests.
    decode_3 = RankBatch(num_reqs=3, num_tokens=6, uniform_token_count=2, max_query_len=2)
    varlen = [
        RankBatch(num_reqs=4, num_tokens=4 + r % 4, max_query_len=1 + r % 2) for r in range(dp)
    ]
    unbounded = list(varlen)
    unbounded[-1] = RankBatch(num_reqs=4, num_tokens=5)  # no query-length bound: -1
    loras = [
        RankBatch(
            num_reqs=4, num_tokens=8, uniform_token_count=2, max_query_len=2, num_active_loras=r % 4
        )
        for r in range(dp)
    ]
    loras_eager = list(loras)
    loras_eager[0] = RankBatch(num_reqs=3, num_tokens=6, need_eager=True, num_active_loras=3)
    d = dpa.DISPATCHER
    return {
        "graph": (d, dpa.batches_for(dp, "graph")),
        "eager": (d, dpa.batches_for(dp, "eager")),
        "idle ranks": (d, [idle if r % 3 == 0 else decode for r in range(dp)]),
        "all idle": (d, [idle] * dp),
        "padded piecewise": (d, spread),
        "uniform disagreed": (d, mixed_uniform),
        "full pads requests": (d, [decode_3] * dp),
        "too big for a graph": (d, [*spread[:-1], RankBatch(num_reqs=9, num_tokens=600)]),
        "varlen bound agreed": (VARLEN, varlen),
        "varlen bound unset": (VARLEN, unbounded),
        "loras": (LORA, loras),
        "loras eager": (LORA, loras_eager),
    }


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_seed_decide_and_seed_whole_decide_as_004_and_as_purepps_finish(dp: int) -> None:
    """On the same reduced tables (the benchmark's graph and eager branches, idle ranks,
    all idle, padding, a disagreed uniform count, an unset query bound, FULL graphs that
    pad requests, a rank too big for any graph; a varlen dispatcher with the query bound
    agreed or unset): `seed_decide` for every rank, and
    `seed_whole` for the benchmark's rank 1 (the other ranks' columns added, no
    collective), decide what 004 decides, and what purepp's `finish_agreement` decides."""
    lanes = AgreementLanes()
    for name, (dispatcher, batches) in _tables(dp).items():
        table = _reduced(batches, dispatcher)
        for rank, b in enumerate(batches):
            expected = _seed_004(batches, rank, table, dispatcher)
            tensor = torch.from_numpy(table.copy())
            descriptor, sync = dpa.seed_decide(
                dispatcher,
                _desired(b, dispatcher),
                tensor,
                num_tokens=b.num_tokens,
                num_reqs=b.num_reqs,
                num_active_loras=b.num_active_loras,
            )
            assert _plain_decision(descriptor, sync) == expected, (name, rank)
            started = start_agreement(
                lanes, AgreementGroup(dp_size=dp, dp_rank=rank), dispatcher, b, step=7
            )
            outcome = finish_agreement(started.state, started.result, table.copy()).result
            assert _plain_decision(outcome.descriptor, outcome.sync) == expected, (name, rank)
        others = table.copy()
        others[:, dpa.RANK] = 0
        whole = dpa.seed_whole(dispatcher, batches[dpa.RANK], dp, others, None)
        assert _plain_decision(*whole) == _seed_004(batches, dpa.RANK, table, dispatcher), name


class _Asked:
    """A dispatcher that notes every question it is asked, answered by `inner`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.asked: list[tuple[int, int, int | None, int, int | None]] = []

    def dispatch(
        self,
        num_reqs: int,
        num_tokens: int,
        uniform_token_count: int | None,
        num_active_loras: int = 0,
        max_query_len: int | None = None,
    ) -> BatchExecutionDescriptor:
        self.asked.append(
            (num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len)
        )
        got: BatchExecutionDescriptor = self.inner.dispatch(
            num_reqs,
            num_tokens,
            uniform_token_count,
            num_active_loras=num_active_loras,
            max_query_len=max_query_len,
        )
        return got


@pytest.mark.parametrize("dp", [2, 8])
def test_the_seed_baselines_ask_the_dispatcher_what_004_asks(dp: int) -> None:
    """004 dispatches the agreed graph with this rank's OWN request count ("so we don't
    perform request padding for PIECEWISE graphs"), the most tokens, the agreed uniform
    count, this rank's LoRA count and the agreed query bound; it asks nothing on the
    eager and idle branches. `seed_whole` first asks for the rank's desired descriptor
    with the rank's own values. purepp's dispatcher answers alike whichever request
    count it is given here, so only the question can tell a baseline that asked with
    the most requests of any rank."""
    for name, (dispatcher, batches) in _tables(dp).items():
        table = _reduced(batches, dispatcher)
        tokens, modes, uniforms, query_lens = (list(map(int, row)) for row in table[:4])
        uniform = uniforms[0] if uniforms[0] and len(set(uniforms)) == 1 else None
        query_len = max(query_lens) if -1 not in query_lens else None
        graph = max(tokens) > 0 and min(modes) > 0
        for rank, b in enumerate(batches):
            asked = _Asked(dispatcher)
            dpa.seed_decide(
                asked,
                _desired(b, dispatcher),
                torch.from_numpy(table.copy()),
                num_tokens=b.num_tokens,
                num_reqs=b.num_reqs,
                num_active_loras=b.num_active_loras,
            )
            agreed = (b.num_reqs, max(tokens), uniform, b.num_active_loras, query_len)
            assert asked.asked == ([agreed] if graph else []), (name, rank)
        b = batches[dpa.RANK]
        asked = _Asked(dispatcher)
        others = table.copy()
        others[:, dpa.RANK] = 0
        dpa.seed_whole(asked, b, dp, others, None)
        own = (b.num_reqs, b.num_tokens, b.uniform_token_count, b.num_active_loras, b.max_query_len)
        agreed = (b.num_reqs, max(tokens), uniform, b.num_active_loras, query_len)
        # A forced-eager rank dispatches nothing of its own (004 builds its eager
        # descriptor), and then every rank runs eager.
        wanted = [] if b.need_eager else [own]
        assert asked.asked == [*wanted, *([agreed] if graph else [])], name


def _decision_of(result: Any) -> Decision:
    """A timed way's answer, whichever side: a Step (purepp) or a (descriptor, sync)."""
    if isinstance(result, tuple):
        return _plain_decision(result[0], result[1])
    outcome = result.result
    return _plain_decision(outcome.descriptor, outcome.sync)


@pytest.mark.parametrize("dp", [2, 8, 64])
@pytest.mark.parametrize("branch", ["graph", "eager"])
def test_every_timed_dp_way_decides_alike_and_the_same_on_every_call(
    dp: int, branch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The four closures dp_agreement times (finish and whole, purepp and seed) answer
    the same decision, 004's for rank 1, on the first call and on the fiftieth (the seed
    pads its reduced tensor in place: the repeated finish must still decide alike); with
    a group, each whole way issues exactly one all-reduce of a [5, dp] int32 tensor."""
    case = dpa.make_case(dp, branch, None)
    batches = dpa.batches_for(dp, branch)
    expected = _seed_004(batches, dpa.RANK, _reduced(batches))
    for way, fn in case.ways.items():
        for _ in range(50):
            assert _decision_of(fn()) == expected, way
    reduced: list[tuple[str, tuple[int, ...], str]] = []

    def all_reduce(tensor: torch.Tensor, group: object = None) -> None:
        reduced.append((str(group), tuple(tensor.shape), str(tensor.dtype)))

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with_group = dpa.make_case(dp, branch, "group")
    for way in ("whole/purepp", "whole/seed"):
        reduced.clear()
        assert _decision_of(with_group.ways[way]()) == expected, way
        assert reduced == [("group", (5, dp), "torch.int32")], way
    for way in ("finish/purepp", "finish/seed"):
        reduced.clear()
        with_group.ways[way]()
        assert reduced == [], way


def test_seed_whole_honours_need_eager_as_004_does() -> None:
    dp = 2
    decode = RankBatch(num_reqs=4, num_tokens=8, uniform_token_count=2, max_query_len=2)
    forced = RankBatch(
        num_reqs=4, num_tokens=8, uniform_token_count=2, max_query_len=2, need_eager=True
    )
    batches = [decode, forced]
    table = _reduced(batches)
    others = table.copy()
    others[:, dpa.RANK] = 0
    whole = dpa.seed_whole(dpa.DISPATCHER, forced, dp, others, None)
    assert _plain_decision(*whole) == _seed_004(batches, dpa.RANK, table)


# ---- 5. the harnesses --------------------------------------------------------------------------


def test_time_rounds_warms_and_times_every_contender_alike() -> None:
    """Every contender gets the same warmup and the same timed steps, in a rotating
    order; the sync between rounds (here a 50 ms sleep) is outside every timed span."""
    ran: dict[str, list[tuple[int, int]]] = {}

    def runner(name: str) -> Callable[[int, int], None]:
        def run(first: int, count: int) -> None:
            ran.setdefault(name, []).append((first, count))

        return run

    contenders = [Contender(n, runner(n), on_device=True) for n in ("seed", "eager", "pure")]
    time_rounds(contenders, steps=5, rounds=3, warmup=7, sync=lambda: time.sleep(0.05))
    for name in ("seed", "eager", "pure"):
        assert ran[name] == [(0, 7), (7, 5), (12, 5), (17, 5)], name
    for c in contenders:
        assert len(c.times) == 3
        assert max(c.times) < 0.05 / 5 / 2, c.name  # the sleep was not timed


def test_host_h2d_copies_as_purepps_cpu_copy_does(
    groups: dict[Communicator, dist.ProcessGroup],
) -> None:
    array = _i32(3, -1, 5)
    interpreter = TorchInterpreter(device=CPU, groups=groups, rank=0)
    theirs = interpreter.to_device(array, Stream.MAIN)
    ours = host_calls().h2d(array, CPU)
    assert np.shares_memory(theirs.numpy(), array) == np.shares_memory(ours.numpy(), array)


def test_pure_breakdown_measures_purepps_consume_on_the_seeds_cycle() -> None:
    """pure_breakdown's receiver consume runs over the states of the seed_noop step's
    cycle (a slot freed every FREE_EVERY steps), so it pays the generation compares and
    the dropped rows the seed's consumes pay there, and not only the steady consume."""
    rows, spec = 64, 3
    one = pure_breakdown.seed_noop_step(False, spec, rows)
    relay: SeedRelay = _closure(_closure(one, "run"), "relay")
    rec = Recorder(relay.calls)
    rec.adopt(relay)
    for _ in range(2 * CYCLE):
        one()
    seed_drops = sum(1 for e in rec.plain if e[0] == "h2d" and -1 in cast(tuple[int], e[1]))
    assert seed_drops > 0
    calls = dict(pure_breakdown.step_calls(False, spec, Wire.SEED, rows))
    consume = calls[pure_breakdown.CONSUME]
    made = [cast(Step[Any, Any], consume()) for _ in range(CYCLE)]
    dropping = [any(isinstance(e, CopyHostToDevice) for e in m.effects) for m in made]
    assert any(dropping)  # consumes after a free drop rows, as the seed's do
    assert not all(dropping)  # and the steady ones drop none
