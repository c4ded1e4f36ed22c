"""Real text that ships with Python, as token windows per workload class.

No task sets can be downloaded here, so quality is measured on text every Python install carries:
``prose`` is the language reference help (``pydoc_data.topics``), ``code`` is standard-library source.
``docs`` is held out of profiling (the paper's "unseen" sets) and different in kind: markup documentation,
IDLE's HTML help and NEWS file, then the reStructuredText/Markdown long descriptions (README pages) of the
installed distributions, by name. Each window is taken from the middle of a different document (past licence
headers and module docstrings); when documents run out, further disjoint spans of the long ones are used.
The choice is deterministic for a given installation.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

WORKLOADS = ("prose", "code")  # profiled
UNSEEN = ("docs",)  # held out of profiling, re-scored with the chosen profiles
ALL_WORKLOADS = WORKLOADS + UNSEEN

# Stdlib modules of ordinary Python code (not generated tables), several thousand tokens each.
CODE_MODULES = ("json.decoder", "textwrap", "heapq", "fractions", "difflib", "argparse", "dataclasses",
                "shlex", "string", "calendar", "configparser", "statistics", "csv", "tokenize", "ftplib",
                "bisect")
IDLE_DOCS = ("help.html", "NEWS.txt")
DOCS_MIN_CHARS = 8000  # distributions whose long description is shorter are skipped
DOCS_EXCLUDE = ("kvtide",)  # this project's own README


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def _docs() -> list[tuple[str, str]]:
    import idlelib
    root = Path(idlelib.__file__).parent
    out = [(f"idlelib/{n}", (root / n).read_text(encoding="utf-8")) for n in IDLE_DOCS]
    seen: set[str] = set()
    dists = sorted(importlib.metadata.distributions(), key=lambda d: (d.metadata["Name"] or "").lower())
    for d in dists:
        name = (d.metadata["Name"] or "").lower()
        if name in seen or name in DOCS_EXCLUDE:
            continue
        seen.add(name)
        text = d.metadata.get_payload() or d.metadata.get("Description") or ""
        if not isinstance(text, str) or len(text) < DOCS_MIN_CHARS:
            continue
        mid = text[len(text) // 2: len(text) // 2 + 400]
        if any(mid in t for _, t in out):  # a fork shipping the same README (httpcore / httpcore2)
            continue
        out.append((f"{name} (package description)", text))
    return out


def named_documents(workload: str) -> list[tuple[str, str]]:
    """(name, text) of the workload's documents in a fixed order."""
    if workload == "prose":
        from pydoc_data.topics import topics
        return [(k, topics[k]) for k in sorted(topics, key=lambda k: (-len(topics[k]), k))]
    if workload == "code":
        return [(m, inspect.getsource(importlib.import_module(m))) for m in CODE_MODULES]
    if workload == "docs":
        return _docs()
    raise ValueError(f"workload must be one of {ALL_WORKLOADS}, got {workload!r}")


def documents(workload: str) -> list[str]:
    """The workload's documents in a fixed order (longest prose topics first; code in CODE_MODULES order)."""
    return [t for _, t in named_documents(workload)]


def windows(tok: Encoder, workload: str, n: int, length: int, docs: Sequence[str] | None = None) -> list[list[int]]:
    """``n`` token windows of ``length`` tokens, each from the middle of a different document."""
    if n < 1:
        raise ValueError(f"need n >= 1, got n={n}")
    return windows_of(tok, workload, [length] * n, docs)


def windows_of(tok: Encoder, workload: str, lengths: Sequence[int],
               docs: Sequence[str] | None = None) -> list[list[int]]:
    """One window per entry of ``lengths`` (in that order), pairwise disjoint.

    Longest requests are served first. Each takes the middle of the first document not used yet that holds it;
    when none is left, the first free span (from a document's start or a used span's end) of any document.
    """
    if not lengths or min(lengths) < 2:
        raise ValueError(f"need at least one length, each >= 2, got {list(lengths)}")
    texts = list(docs) if docs is not None else documents(workload)
    ids: dict[int, list[int]] = {}

    def tokens(j: int) -> list[int]:
        if j not in ids:
            ids[j] = tok.encode(texts[j])
        return ids[j]

    used: dict[int, list[tuple[int, int]]] = {}
    out: list[list[int] | None] = [None] * len(lengths)
    for r in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        L = lengths[r]
        span = _fresh(texts, tokens, used, L) or _free(tokens, used, L)
        if span is None:
            got = sum(w is not None for w in out)
            raise ValueError(f"{workload}: only {got} disjoint windows for lengths {sorted(lengths, reverse=True)}")
        j, s = span
        used.setdefault(j, []).append((s, s + L))
        out[r] = tokens(j)[s: s + L]
    return [w for w in out if w is not None]


def _fresh(texts, tokens, used, L: int) -> tuple[int, int] | None:
    for j, text in enumerate(texts):
        if j in used or len(text) < 2 * L:  # cheap pre-filter before tokenising (a token is >= 1 char of source)
            continue
        n = len(tokens(j))
        if n >= L:
            return j, (n - L) // 2
    return None


def _free(tokens, used, L: int) -> tuple[int, int] | None:
    for j in sorted(used):
        spans = sorted(used[j])
        n = len(tokens(j))
        for s in [0] + [e for _, e in spans]:
            if s + L <= n and all(s + L <= a or s >= b for a, b in spans):
                return j, s
    return None
