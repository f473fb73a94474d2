"""`purepp check` on a large log: throughput (MB/s) and peak memory against the log's size.

Records a scripted PP x DP run (the rank-step program on the simulated world, as the
golden logs are made), then writes it `--repeat` times end to end with steps, step-named
buffers and sequence numbers shifted, so the logs are as long as asked while each step
reads like a real one. The check then runs in a fresh process, so the figures are the
checker's alone:

    python benchmarks/check_throughput.py                      # about 70 MB of logs
    python benchmarks/check_throughput.py --check-only DIR     # an existing folder

Targets (issue 9): at least 20 MB/s, peak resident memory at most 2x the logs' size.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from purepp.effects._converter import CONVERTER
from purepp.effects.log import EffectLog, LogHeader, header_json, log_file_name
from purepp.effects.logmodel import LogRecord, config_digest

_STEP_NAME = re.compile(r"step(\d+)")


def _shifted(value: Any, shift: int) -> Any:
    """`value` (a record's JSON) with every step-named reference moved `shift` steps on."""
    match value:
        case str():
            return _STEP_NAME.sub(lambda m: f"step{int(m[1]) + shift}", value)
        case list():
            return [_shifted(item, shift) for item in value]
        case dict():
            return {key: _shifted(item, shift) for key, item in value.items()}
        case _:
            return value


def generate(directory: Path, *, pp: int, dp: int, steps: int, repeat: int) -> int:
    """Write every rank's log: a `steps`-step scripted run, `repeat` times; total bytes."""
    from purepp.testing import ScheduleConfig, make_schedule, record_scripted_logs

    schedule = make_schedule(ScheduleConfig(pp=pp, dp=dp, spec=2, steps=steps, seed=1))
    logs: tuple[EffectLog, ...] = record_scripted_logs(schedule)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"benchmark": "check_throughput", "steps": steps, "repeat": repeat}
    total = 0
    for log in logs:
        header = LogHeader(
            rank=log.header.rank, world=log.header.world, config=config, run_id="bench",
            config_digest=config_digest(config),
        )  # fmt: skip
        base = [CONVERTER.unstructure(record, LogRecord) for record in log.records]
        collectives: dict[str, int] = {}
        for line in base:
            if line["comm_seq"] is not None:
                comm = line["effect"]["comm"]
                collectives[comm] = collectives.get(comm, 0) + 1
        path = directory / log_file_name(log.header.rank)
        with path.open("w", encoding="ascii") as file:
            file.write(header_json(header) + "\n")
            for rep in range(repeat):
                for line in base:
                    effect = _shifted(line["effect"], rep * steps)
                    effect["step"] = line["effect"]["step"] + rep * steps
                    comm_seq = line["comm_seq"]
                    if comm_seq is not None:
                        comm_seq += rep * collectives[line["effect"]["comm"]]
                    shifted = {
                        "seq": line["seq"] + rep * len(base),
                        "comm_seq": comm_seq,
                        "effect": effect,
                    }
                    file.write(json.dumps(shifted) + "\n")
        total += path.stat().st_size
    return total


def check_only(directory: Path) -> None:
    """Check `directory` in this process and print one JSON line of figures."""
    from purepp.effects.checker import check_logs

    size = sum(path.stat().st_size for path in directory.glob("*.jsonl"))
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    report = check_logs(directory)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    # CPU seconds beside wall seconds: on a shared machine the wall clock also counts
    # the time other processes held the cores.
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    baseline_kib, peak_kib = before.ru_maxrss, after.ru_maxrss
    # The floor on this machine, now: json.loads alone over the same lines.
    parse_start = time.process_time()
    for path in directory.glob("*.jsonl"):
        with path.open("rb") as file:
            for line in file:
                json.loads(line)
    parse_cpu = time.process_time() - parse_start
    print(
        json.dumps(
            {
                "exit_code": report.exit_code,
                "summary": report.text.splitlines()[0],
                "log_mb": round(size / 1e6, 2),
                "records": report.records,
                "seconds": round(seconds, 2),
                "mb_per_s": round(size / 1e6 / seconds, 1),
                "cpu_seconds": round(cpu, 2),
                "mb_per_cpu_s": round(size / 1e6 / cpu, 1),
                "json_loads_only_mb_per_cpu_s": round(size / 1e6 / parse_cpu, 1),
                "baseline_rss_mb": round(baseline_kib * 1024 / 1e6, 1),
                "peak_rss_mb": round(peak_kib * 1024 / 1e6, 1),
                "peak_over_log": round(peak_kib * 1024 / size, 2),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps of the scripted run")
    parser.add_argument("--repeat", type=int, default=10, help="copies of it, end to end")
    parser.add_argument("--pp", type=int, default=3)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--check-only", type=Path, default=None, help="check this folder only")
    args = parser.parse_args()
    if args.check_only is not None:
        check_only(args.check_only)
        return
    with tempfile.TemporaryDirectory(prefix="purepp-check-bench-") as folder:
        start = time.perf_counter()
        size = generate(Path(folder), pp=args.pp, dp=args.dp, steps=args.steps, repeat=args.repeat)
        print(
            f"generated {size / 1e6:.1f} MB (pp={args.pp}, dp={args.dp}, {args.steps} steps"
            f" x {args.repeat}) in {time.perf_counter() - start:.1f} s"
        )
        # A fresh process, so the peak memory is the checker's, not the generator's.
        subprocess.run(
            [sys.executable, __file__, "--check-only", folder], check=True, stdout=sys.stdout
        )


if __name__ == "__main__":
    main()
