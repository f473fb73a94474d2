"""Finding a test run's processes: a marker in the launcher's environment, which every
process it starts inherits, found by scanning /proc."""

from __future__ import annotations

from pathlib import Path

MARK = "PUREPP_TEST_MARK"


def marked_processes(mark: str) -> list[int]:
    """Live (not zombie) processes whose environment carries `MARK=mark`."""
    found = []
    needle = f"{MARK}={mark}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found
