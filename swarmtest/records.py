"""A peer's JSONL records as the tests and benchmarks read them: ``out/<name>.jsonl``, one typed event a line
(``swarm.events``), picked by kind.

    served = records(out, "stage1-a", StateServed)   # no kind: the progress records (``Progress``)
"""

from __future__ import annotations

from pathlib import Path
from typing import overload

from swarm.events import E, Event, Progress, of_kind, read_events


@overload
def records(out: Path, name: str) -> list[Progress]: ...
@overload
def records(out: Path, name: str, kind: type[E]) -> list[E]: ...
def records(out: Path, name: str, kind: type[Event] = Progress) -> list[Event]:
    """A peer's events of ``kind`` in ``out/<name>.jsonl`` (by default its progress records), in order."""
    return of_kind(read_events(out / f"{name}.jsonl"), kind)
