"""`purepp check LOGDIR`: replay the ranks' effect logs through the matching scheduler.

The logs are read a record at a time, every rank's file at once, and fed through the
scheduler the simulator uses (`purepp.effects.scheduler`): one `CollectiveHub` for
every communicator and one data-free `StreamLanes` per rank. So the checker sees what
a per-communicator comparison cannot: two ranks taking two communicators in opposite
orders wait on each other, and the report shows the wait-for cycle. A broadcast blocks
its host when the header's config names the gloo backend (`purepp run`'s default), as
gloo's does (until gloo's tree lets that member go); otherwise it holds only its
stream, as NCCL's does (`backend=` names it for logs whose header does not; without it
they are judged as NCCL's, with a note when gloo's model judges them otherwise). Memory
stays bounded because a rank may not run more than `max_steps_in_flight` steps ahead of the
slowest stage of its pipeline: only the records between them are held. Reading is
fast where logs repeat themselves: a line that differs from an already validated line
only in its digits is not validated again, and records that never wait are not built
(`LogStream.scan`).

Outcomes (`CheckReport.exit_code`):
- 0: every collective matched on every communicator, and every agreement was decided
  alike;
- 1: a finding: a mismatch (classified, with its culprit rank), a deadlock (with its
  wait-for cycle), the stages of one replica contributing different columns to one
  agreement (a stage divergence: they would run different shapes), ranks that noted
  different decisions for one agreement (a decision divergence), a log that ends
  mid-record (the rank died while writing; the report says what every rank was waiting
  on), a rank with no log (it died before writing its header, or its log was not
  copied: the others are checked with it as a rank that issued nothing, and the report
  names its file and says what every rank was waiting on), a rank whose log holds only
  the start of its header (it died while writing its first line: checked as a rank with
  no log, the report saying its header was cut), or logs that recorded nothing;
- 2: the logs cannot be used: none at all, unreadable, corrupted before their last
  line (a whole first line that is no header, too), of other runs or configs mixed in
  one folder, headers that disagree on the world (so which rank has no log cannot be
  known), or none but cut headers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final, TextIO

import attrs

from purepp._checks import check_int
from purepp._text import a_type, counted
from purepp.effects._converter import EFFECT_KINDS
from purepp.effects.logfile import (
    CutHeader,
    LogStream,
    as_path,
    check_same_run,
    log_dir_writer,
    log_file_name,
    log_paths,
    read_cut_header,
)
from purepp.effects.matching import (
    AwaitedCollective,
    CollectiveReportError,
    DeadlockReport,
    MismatchReport,
    Report,
    WaitEdge,
    Waiter,
    find_wait_cycle,
)
from purepp.effects.numpy_interpreter import describe_effect
from purepp.effects.scheduler import (
    LOCAL_KINDS,
    CollectiveHub,
    StreamLanes,
    started_ahead,
    waiting_at,
)
from purepp.effects.vocabulary import AllReduce, Backend, Broadcast, Effect, Stream, check_backend
from purepp.errors import ConfigError, InvalidInputError, LogFormatError
from purepp.layout import Layout

__all__ = [
    "EXIT_FINDING",
    "EXIT_OK",
    "EXIT_UNUSABLE",
    "CheckReport",
    "CutLog",
    "check_log_dir",
    "check_logs",
]

EXIT_OK: Final = 0  # every collective matched
EXIT_FINDING: Final = 1  # a mismatch, a deadlock, a log cut or missing, or nothing recorded
EXIT_UNUSABLE: Final = 2  # the logs cannot be read as one run's

_CALL = "purepp check"
_COLLECTIVE_KINDS: Final = frozenset(
    kind for kind, cls in EFFECT_KINDS.items() if cls in (Broadcast, AllReduce)
)
# The one kind the backends' models differ on (gloo's holds its host).
_BROADCAST_KINDS: Final = frozenset(kind for kind, cls in EFFECT_KINDS.items() if cls is Broadcast)


@attrs.frozen(kw_only=True)
class CutLog:
    """A rank's log whose last line was cut mid-record: the rank died while writing."""

    rank: int  # the rank that wrote it
    path: Path  # the file
    line: int  # the cut line's number (everything before it was read)
    records: int  # complete records before the cut
    last_step: int | None  # step of the last complete record; None when there is none

    def describe(self) -> str:
        after = "no record" if self.last_step is None else f"step {self.last_step}"
        return (
            f"rank {self.rank}'s log ends mid-record at {self.path.name} line {self.line}"
            f" (the rank died while writing), after {self.records} records ({after})"
        )


@attrs.frozen(kw_only=True)
class CheckReport:
    """What `purepp check` found in one folder of logs."""

    ok: bool  # every collective matched, and something was recorded
    exit_code: int  # EXIT_OK, EXIT_FINDING or EXIT_UNUSABLE
    text: str  # a one-line summary when ok, else the full report (several lines)
    ranks: int = 0  # logs read, one per rank that has one
    records: int = 0  # records read, all ranks together
    collectives: int = 0  # collectives issued, all ranks together
    steps: int = 0  # distinct decode steps seen (the most any rank logged)
    finding: Report | None = None  # the mismatch or deadlock, if any
    cut: tuple[CutLog, ...] = ()  # logs that end mid-record
    # Ranks with no log in the folder, checked as ranks that issued nothing.
    absent: tuple[int, ...] = ()
    # Logs holding only the start of their header (their ranks are among `absent`,
    # where the header or the file's name says which).
    cut_headers: tuple[CutHeader, ...] = ()
    # The backend whose model judged the logs (None: they could not be used).
    backend: Backend | None = None


def check_logs(
    directory: str | os.PathLike[str],
    *,
    max_steps_in_flight: int | None = None,
    backend: Backend | None = None,
) -> CheckReport:
    """Check the ranks' logs in `directory` (as `purepp run --log-dir` writes them).

    Never raises for bad logs: an unusable folder is a report with exit code 2.
    `max_steps_in_flight` (default: the world's pp, as `simulate`) bounds how far a
    rank is replayed ahead of its pipeline's slowest stage, and so the memory held.
    `backend` ('nccl' or 'gloo') says what the logs ran on when their header does not
    (a scripted run's): gloo's broadcast blocks its host, NCCL's only its stream. Without
    it such logs are judged as NCCL's, with a note when gloo's model judges them
    otherwise (so logs with a broadcast, the one effect the models differ on, are read
    twice); one that contradicts the header makes the logs unusable.
    """
    # Not a path at all is the caller's bug, raised; a path to no usable logs is a report.
    folder = as_path("check_logs", "directory", directory)
    if backend is not None:
        backend = check_backend("check_logs", "backend", backend)
    try:
        if max_steps_in_flight is not None:
            check_int("check_logs", "max_steps_in_flight", max_steps_in_flight, 1, config=True)
        check = _Check(folder, max_steps_in_flight, backend)
        report = check.run()
        if check.backend_assumed and check.broadcast_issued:
            report = _noted_if_gloo_differs(report, folder, max_steps_in_flight)
    except (LogFormatError, ConfigError) as error:
        # Under the check's own name: the reader's (load_log, load_logs) is not what was run.
        text = f"{_CALL}: {error.problem}. Fix: {error.fix}"
        report = CheckReport(ok=False, exit_code=EXIT_UNUSABLE, text=text)
    writer = log_dir_writer(folder)
    if writer is None:
        return report
    # A live run's logs end where each rank is now: read as a cut or a hang, they are not.
    return attrs.evolve(
        report,
        text=f"{report.text}\nnote: a purepp run (pid and run id: {writer}) is still writing"
        " these logs: this is the check of the logs so far; check them again when it ends",
    )


def _noted_if_gloo_differs(
    report: CheckReport, folder: Path, max_steps_in_flight: int | None
) -> CheckReport:
    """`report`, judged as NCCL's for want of a backend, with a note when gloo's model
    judges the same logs otherwise (a broadcast that holds its host can deadlock)."""
    gloo = _Check(folder, max_steps_in_flight, "gloo").run()
    # The verdict is the exit code and the headline; what each rank waits on below it
    # differs between the models even where the verdict is the same.
    verdict, headline = _verdict(gloo), _verdict(report)
    if (gloo.exit_code, verdict) == (report.exit_code, headline):
        return report
    verdict = verdict.rstrip(".:")
    return attrs.evolve(
        report,
        text=f"{report.text}\nnote: the logs' header names no backend, so they were judged as "
        f"NCCL's; as gloo's (a broadcast holds its host) they give exit {gloo.exit_code}: "
        f"{verdict}; if they ran on gloo, check them with --backend gloo",
    )


# The report's first lines name the missing and cut logs, read alike by both models.
_LOG_LINES: Final = ("Log missing: ", "Log cut: ")


def _verdict(report: CheckReport) -> str:
    """The report's headline past the lines naming missing and cut logs: the finding's
    first line, or what matched."""
    lines = (line for line in report.text.splitlines() if not line.startswith(_LOG_LINES))
    return next(lines, "").strip()


def check_log_dir(
    directory: str | os.PathLike[str], out: TextIO | None = None, *, backend: Backend | None = None
) -> int:
    """Print `check_logs(directory, backend=backend)`'s text to `out` (default stdout);
    return its exit code."""
    if out is not None and not callable(getattr(out, "write", None)):
        raise InvalidInputError(
            "check_log_dir",
            f"out is {a_type(out)}, not a text stream",
            "pass a text stream such as sys.stderr or an io.StringIO, or None for stdout",
        )
    report = check_logs(directory, backend=backend)
    print(report.text, file=sys.stdout if out is None else out)
    return report.exit_code


# -- one rank's log, replayed ----------------------------------------------------------


class _RankReplay:
    """One rank: its log read lazily, one record of lookahead, and its streams."""

    def __init__(
        self, rank: int, world: Layout, stream: LogStream | None, lanes: StreamLanes
    ) -> None:
        # None: the rank has no log, replayed as a log that ends after its header
        self.stream = stream
        self.rank = rank
        # the other stages of its pipeline: it may not run too far ahead of them
        self.peers = tuple(r for r in world.pipeline(world.dp_index(self.rank)) if r != self.rank)
        self.lanes = lanes
        # Records that never wait come as their step and kind only (see LOCAL_KINDS).
        self.items = iter(()) if stream is None else stream.scan(LOCAL_KINDS)
        # the next record (or run of records that never wait), once read
        self.next: tuple[int, str, Effect | None, int] | None = None
        self.ended = False  # the log has no more records
        self.records = 0  # records issued
        self.collectives = 0  # collectives issued
        # Distinct steps issued, counted as new highest steps: a step's records may come
        # between the next step's (`purepp run --overlap-agreement` starts step s + 1's
        # agreement inside step s), but no step starts before a lower one.
        self.steps = 0
        self.top_step: int | None = None  # the highest step issued
        self.last_step: int | None = None  # step of the last record issued
        self.allowed_step = -1  # steps up to this one may be issued without re-checking peers
        # the step of the last record issued that was not an agreement started ahead
        self.order_step: int | None = None

    def peek(self) -> tuple[int, str, Effect | None, int] | None:
        if self.next is None and not self.ended:
            item = next(self.items, None)
            if item is None:
                self.ended = True
            else:
                self.next = item
        return self.next

    def progress(self) -> int | None:
        """Steps below this one are fully issued; None when the log ended with no record."""
        item = self.peek()
        if item is not None:
            ahead = started_ahead(item[2], self.order_step)
            return self.order_step if ahead and self.order_step is not None else item[0]
        return None if self.last_step is None else self.last_step + 1


class _Check:
    def __init__(
        self, directory: Path, max_steps_in_flight: int | None, backend: Backend | None
    ) -> None:
        self._directory = directory
        self._in_flight_option = max_steps_in_flight
        self._backend_option = backend
        self.backend_assumed = False  # the header named none and neither did the caller
        # A broadcast was replayed: without one, gloo's model replays the same (so the
        # check is not run again under it).
        self.broadcast_issued = False
        self._backend: Backend = "nccl"  # the one judged by (set once the headers are read)
        self._ranks: list[_RankReplay] = []
        self._advancers: list[Callable[[], object]] = []  # each rank's `lanes.advance`
        self._cut_headers: tuple[CutHeader, ...] = ()
        self._cut_by_rank: dict[int, CutHeader] = {}  # of the ranks they are known to be

    def run(self) -> CheckReport:
        streams: list[LogStream] = []
        cut_headers: list[CutHeader] = []
        try:
            for path in log_paths(self._directory):
                try:
                    streams.append(LogStream(path, allow_cut_end=True, call=_CALL))
                except LogFormatError:
                    # Only the start of a header: the rank died writing its first line, so
                    # it recorded nothing, as a rank with no log. Anything else is corrupt.
                    cut = read_cut_header(path)
                    if cut is None:
                        raise
                    cut_headers.append(cut)
            if not streams:
                names = ", ".join(c.path.name for c in cut_headers[:4])
                raise LogFormatError(
                    "check_logs",
                    f"{self._directory}: every log holds only a cut header ({names}"
                    f"{', ...' if len(cut_headers) > 4 else ''}): no rank wrote its header, so "
                    "the world and the run are not known (every rank died while writing its "
                    "first line)",
                    "find why the ranks died at their start (their output), and run again",
                )
            # A rank with no log (it died before its header, or its file was not copied)
            # is known from the others' headers: the rest are still worth checking.
            check_same_run(
                self._directory, [(s.path, s.header) for s in streams], allow_missing=True
            )
            self._place_cut_headers(streams, cut_headers)
            return self._replay(streams)
        finally:
            for stream in streams:
                stream.close()

    def _place_cut_headers(self, streams: list[LogStream], cut_headers: list[CutHeader]) -> None:
        """Which absent rank each cut header is: its header says, or else its file's name.

        Raises LogFormatError for one that cannot be of this run: of another world, of
        a rank that has a log, or of none (every rank has a log).
        """
        world = streams[0].header.world
        first = streams[0].path.name
        logged = {s.header.rank: s.path.name for s in streams}
        by_rank: dict[int, CutHeader] = {}

        def refuse(problem: str) -> LogFormatError:
            return LogFormatError(
                "check_logs",
                f"{self._directory}: {problem}",
                "keep only the logs of one run in the directory",
            )

        for cut in cut_headers:
            name = cut.path.name
            if cut.world is not None and cut.world != world:
                raise refuse(
                    f"{name} holds a cut header of world pp={cut.world.pp}, dp={cut.world.dp}"
                    f" but {first} is of pp={world.pp}, dp={world.dp}"
                )
            if cut.rank is None:
                continue
            if cut.rank >= world.world_size:
                raise refuse(
                    f"{name} holds a cut header of rank {cut.rank}, but {first} is of a world "
                    f"of {world.world_size} ranks (pp={world.pp}, dp={world.dp})"
                )
            if cut.rank in logged:
                other = f"{logged[cut.rank]} is rank {cut.rank}'s log"
            elif cut.rank in by_rank:
                other = f"{by_rank[cut.rank].path.name} holds one of rank {cut.rank} too"
            else:
                other = None
            if other is not None:
                raise refuse(
                    f"{name} holds a cut header of rank {cut.rank}, but {other}: a rank "
                    "writes one log a run"
                )
            by_rank[cut.rank] = cut
        # Cut before its rank: the name dump_logs and purepp run give that rank's log says.
        names = {log_file_name(rank): rank for rank in range(world.world_size)}
        for cut in cut_headers:
            if cut.rank is None:
                rank = names.get(cut.path.name)
                if rank is not None and rank not in logged and rank not in by_rank:
                    by_rank[rank] = cut
        unplaced = [c for c in cut_headers if c not in by_rank.values()]
        if unplaced and len(logged) + len(by_rank) == world.world_size:
            has = "a log or a cut header of its own" if by_rank else "a log"
            raise refuse(
                f"{unplaced[0].path.name} holds a cut header, but every rank of the world of "
                f"{world.world_size} (pp={world.pp}, dp={world.dp}) has {has}: it is not of "
                "this run"
            )
        self._cut_headers = tuple(cut_headers)
        self._cut_by_rank = by_rank

    def _replay(self, streams: list[LogStream]) -> CheckReport:
        world = streams[0].header.world
        by_rank: dict[int, LogStream] = {s.header.rank: s for s in streams}
        in_flight = world.pp if self._in_flight_option is None else self._in_flight_option
        if in_flight < 1:
            raise ConfigError(
                "check_logs", f"max_steps_in_flight={in_flight}", "allow at least one step"
            )
        backend = self._judged_backend(streams[0].header.config.get("backend"))
        self._world, self._in_flight, self._backend = world, in_flight, backend
        self._hub = CollectiveHub(world, call=_CALL, move_data=False, backend=backend)
        # Indexed by rank, every rank of the world, those with no log too.
        self._ranks = [
            _RankReplay(
                rank, world, by_rank.get(rank), StreamLanes(rank, self._hub, backend=backend)
            )
            for rank in range(world.world_size)
        ]
        self._advancers = [r.lanes.advance for r in self._ranks]
        self._names = {s.path.name: s.header.rank for s in streams}
        try:
            while not self._done():
                progressed = False
                for rank in self._ranks:
                    progressed |= self._advance(rank)
                if not progressed:
                    try:  # a divergence found earlier comes first, with what each waits on
                        self._hub.raise_held()
                    except CollectiveReportError as error:
                        return self._finding(error.report, self._deadlock())
                    return self._stuck()
            self._hub.raise_held()
        except CollectiveReportError as error:
            return self._finding(error.report)
        return self._completed()

    def _judged_backend(self, written: object) -> Backend:
        """The run's backend decides whether a broadcast blocks its host (gloo) or only its
        stream (NCCL): the header's, else the caller's, else NCCL's (`backend_assumed`:
        check_logs then adds gloo's verdict where it differs)."""
        given = self._backend_option
        if written is None:
            self.backend_assumed = given is None
            return "nccl" if given is None else given
        backend = check_backend(
            "check_logs",
            "the backend in the logs' header config",
            written,
            "record the logs again (`purepp run --backend nccl|gloo` writes the one it ran on)",
        )
        if given is not None and given != backend:
            raise ConfigError(
                "check_logs",
                f"backend={given!r} was given but the logs' header says they ran on {backend!r}",
                "leave the backend out: the header's is the one the run used",
            )
        return backend

    # -- scheduling --

    def _done(self) -> bool:
        return (
            all(r.peek() is None and r.lanes.idle() for r in self._ranks)
            and not self._hub.incomplete()
        )

    def _advance(self, rank: _RankReplay) -> bool:
        """Issue `rank`'s effects until its host blocks, its log ends or it is held back."""
        progressed = False
        lanes, hub, items = rank.lanes, self._hub, rank.items
        host_blocked, main_idle = lanes.host_blocked, lanes.main_idle
        # The check's hot loop: `peek` inlined, and the counts of the records taken.
        while not host_blocked():
            item = rank.next
            if item is None:
                item = None if rank.ended else next(items, None)
                if item is None:
                    rank.ended = True
                    return progressed
                rank.next = item
            step, kind, effect, count = item
            # An agreement started ahead is never held back and begins no step. (Records
            # that never wait come without their effect: no call for them.)
            if effect is None or not started_ahead(effect, rank.order_step):
                if rank.order_step is not None and step > rank.order_step and not main_idle():
                    return progressed  # the host reads the last step's outputs first
                if step > rank.allowed_step:
                    if self._held_back_by(rank, step):
                        return progressed
                    rank.allowed_step = step
                rank.order_step = step
            rank.next = None
            rank.records += count
            if rank.top_step is None or step > rank.top_step:
                rank.steps += 1
                rank.top_step = step
            rank.last_step = step
            if effect is not None:
                if kind in _COLLECTIVE_KINDS:
                    rank.collectives += 1
                    if kind in _BROADCAST_KINDS:
                        self.broadcast_issued = True
                lanes.issue(effect)
                if hub.completed_ranks:
                    hub.run_completed(self._advancers)
            progressed = True
        return progressed

    def _between_steps(self, rank: _RankReplay) -> bool:
        """Whether `rank` waits to start its next step until its main stream has run:
        a run's host reads each step's outputs (unlogged), which waits for the main
        stream as a `.cpu()` copy does, and the simulator's programs read between yields."""
        item = rank.peek()
        return (
            item is not None
            and rank.order_step is not None
            and item[0] > rank.order_step
            and not started_ahead(item[2], rank.order_step)
            and not rank.lanes.main_idle()
        )

    def _held_back_by(self, rank: _RankReplay, step: int) -> tuple[int, ...]:
        """Pipeline peers too far behind for `rank` to issue an effect of `step`."""
        limit = step - self._in_flight
        behind = []
        for peer in rank.peers:
            progress = self._ranks[peer].progress()
            if progress is not None and progress <= limit:
                behind.append(peer)
        return tuple(behind)

    # -- outcomes --

    def _report(
        self,
        text: str,
        *,
        ok: bool = False,
        finding: Report | None = None,
        cut: tuple[CutLog, ...] = (),
    ) -> CheckReport:
        return CheckReport(
            ok=ok,
            exit_code=EXIT_OK if ok else EXIT_FINDING,
            text=text,
            ranks=sum(r.stream is not None for r in self._ranks),
            records=sum(r.records for r in self._ranks),
            collectives=sum(r.collectives for r in self._ranks),
            steps=max((r.steps for r in self._ranks), default=0),
            finding=finding,
            cut=cut,
            absent=self._absent(),
            cut_headers=self._cut_headers,
            backend=self._backend,
        )

    def _absent(self) -> tuple[int, ...]:
        return tuple(r.rank for r in self._ranks if r.stream is None)

    def _cut(self) -> tuple[CutLog, ...]:
        return tuple(
            CutLog(
                rank=r.rank,
                path=r.stream.path,
                line=r.stream.cut_line,
                records=r.records,
                last_step=r.last_step,
            )
            for r in self._ranks
            if r.stream is not None and r.stream.cut_line is not None
        )

    def _missing_and_cut_lines(self, cut: tuple[CutLog, ...]) -> list[str]:
        """The report's first lines: the ranks with no log (or a cut header), then the
        cut headers of ranks not known, then the logs cut mid-record."""
        lines = []
        for rank in self._absent():
            name = log_file_name(rank)
            # Headers decide the ranks: a file of that name may hold another rank's log.
            holder = self._names.get(name)
            cut_header = self._cut_by_rank.get(rank)
            if cut_header is not None:
                where = cut_header.describe()
            elif holder is None:
                where = (
                    f"{name} is absent (the rank died before writing its header, or its log "
                    "was not copied)"
                )
            else:
                where = (
                    f"no log has its header ({name} holds rank {holder}'s) (the rank died "
                    "before writing its header, or its log was not copied)"
                )
            lines.append(
                f"Log missing: rank {rank} of a world of {self._world.world_size} "
                f"(pp={self._world.pp}, dp={self._world.dp}) has no log: {where}; the other "
                "ranks are checked with it as a rank that issued nothing"
            )
        lines += [
            f"Log cut: {c.describe()}; which rank wrote it is not known (the cut came before "
            "its rank)"
            for c in self._cut_headers
            if c not in self._cut_by_rank.values()
        ]
        return lines + [f"Log cut: {c.describe()}" for c in cut]

    def _completed(self) -> CheckReport:
        cut = self._cut()
        if cut or self._absent():
            lines = self._missing_and_cut_lines(cut)
            logged = "logged before the cut" if cut else "logged"
            lines.append(f"  every collective {logged} matched; each rank's log ends:")
            lines += [f"  {self._ended(r)}" for r in self._ranks]
            return self._report("\n".join(lines), cut=cut)
        summary = self._report("")
        if summary.records == 0:
            return self._report(
                f"nothing recorded: the logs of {counted(summary.ranks, 'rank')} hold a header"
                " and no effect: the run issued none (it stopped before its first step, its"
                " steps had nothing to relay or agree, as prefill chunks that sample nothing on"
                " one replica, or logging was off); record a longer run (purepp run: raise"
                " --steps, or pass --steps 0 to run every request to the end)"
            )
        alike = self._hub.decided_alike
        decided = f", every rank decided its {counted(alike, 'agreement')} alike" if alike else ""
        return self._report(
            f"ok: {counted(summary.ranks, 'rank')}, "
            f"{counted(summary.collectives, 'collective')} over "
            f"{counted(summary.steps, 'step')}, every communicator matches{decided}",
            ok=True,
        )

    def _where_ended(self, rank: _RankReplay) -> str:
        return "before its first step" if rank.last_step is None else f"at step {rank.last_step}"

    def _ended(self, rank: _RankReplay) -> str:
        if rank.stream is None:
            cut = " (its header was cut)" if rank.rank in self._cut_by_rank else ""
            return f"rank {rank.rank}: no log{cut}"
        where = self._where_ended(rank)
        return f"rank {rank.rank}: log ends {where} ({rank.records} records), nothing pending"

    def _never_posted(self, rank: _RankReplay, report: MismatchReport) -> str:
        op = f"op #{report.seq} on {report.comm.value}"
        if rank.stream is None:
            why = (
                "its header was cut (the rank died while writing it)"
                if rank.rank in self._cut_by_rank
                else "the rank died before writing its header, or its log was not copied"
            )
            return f"  rank {rank.rank} has no log, so no record of {op}: {why}"
        return (
            f"  rank {rank.rank}'s log ends {self._where_ended(rank)} ({rank.records} records), "
            f"before {op}: the rank died or stopped there, or skipped it"
        )

    def _finding(self, report: Report, waiting: DeadlockReport | None = None) -> CheckReport:
        cut = self._cut()
        lines = self._missing_and_cut_lines(cut)
        lines.append(report.render())
        if isinstance(report, MismatchReport) and report.received is None:
            # A log that ends before the op: that rank may have died there, not skipped it.
            lines += [
                self._never_posted(r, report)
                for r in self._ranks
                if r.rank in report.missing and r.peek() is None
            ]
        if waiting is not None and waiting is not report:
            lines.append("What every rank was waiting on:")
            lines += [f"  {w.describe()}" for w in waiting.waiters]
            ended = [r for r in waiting.finished if self._ranks[r].stream is not None]
            if ended:
                lines.append(f"  logs ended: rank(s) {', '.join(str(r) for r in ended)}")
            absent = [r for r in waiting.finished if self._ranks[r].stream is None]
            if absent:
                lines.append(f"  no log: rank(s) {', '.join(str(r) for r in absent)}")
        return self._report("\n".join(lines), finding=report, cut=cut)

    def _stuck(self) -> CheckReport:
        deadlock = self._deadlock()
        missing = self._missing_rank(deadlock.pending)
        if missing is not None and deadlock.cycle is None:
            return self._finding(missing, deadlock)
        return self._finding(deadlock)

    def _at_step(self, rank: _RankReplay) -> int | None:
        item = rank.peek()
        # A log that ended on a stuck main stream is at that stream's step, as in the
        # simulator (its program waits for the main stream before it ends).
        ended_stuck = item is None and not rank.lanes.main_idle()
        if rank.lanes.host_blocked() or ended_stuck or self._between_steps(rank):
            return rank.lanes.at_step()
        return None if item is None else item[0]

    def _missing_rank(self, pending: tuple[AwaitedCollective, ...]) -> MismatchReport | None:
        """The earliest op some member will never post: its log ended before it."""
        ended = {r.rank for r in self._ranks if r.peek() is None}
        candidates = [a for a in pending if a.missing and set(a.missing) <= ended]
        if not candidates:
            return None
        awaited = min(candidates, key=lambda a: (a.signature.step, a.instance.group, a.seq))
        # A member that gloo's tree has let go from the op no longer waits on it.
        waiting = min(r for r in awaited.instance.group if self._hub.holds(awaited, r))
        return MismatchReport(
            rank=waiting,
            instance=awaited.instance,
            seq=awaited.seq,
            expected=awaited.signature,
            peer=None,
            received=None,
            differing=(),
            missing=awaited.missing,
            culprit=awaited.missing[0],
        )

    def _deadlock(self) -> DeadlockReport:
        waiters: list[Waiter] = []
        edges: list[WaitEdge] = []
        for rank in self._ranks:
            for stream, effect, culprit in rank.lanes.stalls():
                waiters.append(
                    Waiter(
                        rank=rank.rank,
                        stream=Stream.MAIN if stream is None else stream,
                        host=stream is None,
                        step=effect.step,
                        op=effect.op,
                        waiting_at=waiting_at(effect, self._backend),
                        awaited=None if culprit is None else self._hub.awaited(culprit),
                    )
                )
                if culprit is not None:
                    edges += self._hub.waits_for(culprit)
            upcoming = rank.peek()
            if rank.lanes.host_blocked() or upcoming is None or self._between_steps(rank):
                continue
            step, kind, next_effect, _ = upcoming
            held_back_by = self._held_back_by(rank, step)
            waiters.append(
                Waiter(
                    rank=rank.rank,
                    stream=None,
                    step=step,
                    op=None if next_effect is None else next_effect.op,
                    waiting_at=f"{kind if next_effect is None else describe_effect(next_effect)},"
                    " not yet issued"
                    f" (max_steps_in_flight={self._in_flight})",
                    awaited=None,
                    held_back_by=held_back_by,
                )
            )
            edges += [WaitEdge(rank=rank.rank, via=None, seq=None, peer=p) for p in held_back_by]
        # A log that ends in a wait of its host or main stream ended in a hang, not a finish.
        finished = tuple(
            r.rank
            for r in self._ranks
            if r.peek() is None and not r.lanes.host_blocked() and r.lanes.main_idle()
        )
        return DeadlockReport(
            waiters=tuple(waiters),
            pending=self._hub.incomplete(),
            finished=finished,
            at_steps=tuple(self._at_step(r) for r in self._ranks),
            cycle=find_wait_cycle(edges),
            unwaited=tuple(
                (rank.rank, effect) for rank in self._ranks for effect in rank.lanes.unwaited()
            ),
        )
