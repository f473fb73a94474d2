"""Wording shared by the reports purepp prints."""

from __future__ import annotations

__all__ = ["counted"]


def counted(count: int, noun: str) -> str:
    """`count` and `noun`, plural unless the count is one: "1 rank", "3 ranks"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"
