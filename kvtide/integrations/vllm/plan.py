"""What the scheduler side tells the worker each step, and what the worker reports back.

Plain dataclasses of ints, strings and lists, so they pickle and cross vLLM's process boundary unchanged. A chunk
travels with its key and its token ids: the worker checks every record's token ids against the request's (a hash
collision or a mixed-up entry is a load error, never KV of another prompt).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChunkRef:
    """Full chunk ``index`` of a request: its chained key (hex) and its token ids."""

    key: str
    index: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class LoadSpec:
    """Place tokens [start, end) of request ``req_id`` from ``chunks`` (which cover them, in order) into its
    blocks ``block_ids`` (the request's block table)."""

    req_id: str
    start: int
    end: int
    chunks: tuple[ChunkRef, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SaveSpec:
    """Copy ``chunks`` of request ``req_id`` out of its blocks after this step's forward pass and store them."""

    req_id: str
    chunks: tuple[ChunkRef, ...]
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    """One step's loads and saves; ``parts`` (tokens cached before, tokens computed) per scheduled request, for
    the prefill model; ``counts``: scheduler-side counters (lookups, hits, the split) to report with the step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    parts: list[tuple[int, int]] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)


@dataclass
class WorkerReport:
    """The worker's measurements of one or more steps and the chunks the scheduler must not take as stored.

    ``steps``: (parts, compute seconds: the step less its waits for loads); ``loads``: (token x layers, bytes, seconds) of
    load jobs; ``failed``: keys of chunks whose load failed (deleted or damaged: to be written again);
    ``unsaved``: keys of chunks whose write failed or was skipped."""

    steps: list[tuple[list[tuple[int, int]], float]] = field(default_factory=list)
    loads: list[tuple[int, int, float]] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    unsaved: list[str] = field(default_factory=list)

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        return WorkerReport(self.steps + other.steps, self.loads + other.loads, self.failed + other.failed,
                            self.unsaved + other.unsaved)

    def empty(self) -> bool:
        return not (self.steps or self.loads or self.failed or self.unsaved)
