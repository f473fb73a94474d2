"""Wording shared by the reports and error messages purepp prints."""

from __future__ import annotations

__all__ = ["a_type", "counted", "with_article"]


def counted(count: int, noun: str) -> str:
    """`count` and `noun`, plural unless the count is one: "1 rank", "3 ranks"."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def with_article(name: str) -> str:
    """`name` after "a" or "an", by its first letter: "an int", "a str", "an EventRef"."""
    return f"an {name}" if name[:1] in "aeioAEIOU" else f"a {name}"


def a_type(value: object) -> str:
    """What an error calls `value`'s type: "an int", "a NoneType"."""
    return with_article(type(value).__name__)
