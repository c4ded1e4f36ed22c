"""Real text that ships with Python, as token windows per workload class.

No task sets can be downloaded here, so quality is measured on text every Python install carries:
``prose`` is the language reference help (``pydoc_data.topics``), ``code`` is standard-library source.
Each window comes from a different document and is taken from its middle (past licence headers and
module docstrings), so samples differ in topic; the choice is deterministic.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from typing import Protocol

WORKLOADS = ("prose", "code")

# Stdlib modules of ordinary Python code (not generated tables), several thousand tokens each.
CODE_MODULES = ("json.decoder", "textwrap", "heapq", "fractions", "difflib", "argparse", "dataclasses",
                "shlex", "string", "calendar", "configparser", "statistics", "csv", "tokenize", "ftplib",
                "bisect")


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def documents(workload: str) -> list[str]:
    """The workload's documents in a fixed order (longest prose topics first; code in CODE_MODULES order)."""
    if workload == "prose":
        from pydoc_data.topics import topics
        return [topics[k] for k in sorted(topics, key=lambda k: (-len(topics[k]), k))]
    if workload == "code":
        return [inspect.getsource(importlib.import_module(m)) for m in CODE_MODULES]
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


def windows(tok: Encoder, workload: str, n: int, length: int, docs: Sequence[str] | None = None) -> list[list[int]]:
    """``n`` token windows of ``length`` tokens, each from the middle of a different document."""
    if n < 1 or length < 2:
        raise ValueError(f"need n >= 1 and length >= 2, got n={n}, length={length}")
    out: list[list[int]] = []
    for text in docs if docs is not None else documents(workload):
        if len(text) < 2 * length:  # cheap pre-filter before tokenising (a token is >= 1 char of source)
            continue
        ids = tok.encode(text)
        if len(ids) < length:
            continue
        start = (len(ids) - length) // 2
        out.append(ids[start: start + length])
        if len(out) == n:
            return out
    raise ValueError(f"{workload}: only {len(out)} documents hold {length} tokens, wanted {n}")
