"""Code under kvtide/ holds contracts and reasons, not lab notes.

Figures of particular runs, the hosts they ran on, their dates and their result files belong in docs/benchmarks.md
and docs/history.md; the "why" of a design belongs in docs/design/. This test keeps them out of the source: it scans
every .py/.cu/.cuh/.h file under kvtide/ line by line for the patterns below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvtide"
SUFFIXES = {".py", ".cu", ".cuh", ".h"}

_UNIT = r"(?:ms|us|µs|ns|s|GB/s|MB/s|GiB/s|MiB/s|x|%)"  # no Gbps: link rates are settings
PATTERNS: dict[str, re.Pattern[str]] = {
    # a result file belongs in docs/benchmarks.md
    "result path": re.compile(r"bench/results"),
    # the run log's numbered entries belong in docs/history.md
    "run log": re.compile(r"\bHISTORY(?:\.md)?\b"),
    # GPU products; an architecture requirement (sm_90, Hopper) that code checks is not one of these
    "GPU product": re.compile(
        r"\b(?:[HAB][12]00|H800|A800|A10G|GB200|GH200|L40S?|V100|P100|MI[23]\d\dX?)\b"
        r"|\b(?:RTX|GTX)[ -]?\d{3,4}\b|\bGeForce\b|\bQuadro\b"),
    # a date of a run
    "date": re.compile(r"\b20\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b"),
    # run counts and session numbers of the lab notebook
    "run count": re.compile(
        r"\bruns?\s+#?\d+\b|\b\d+\s+runs\s+(?:of|each)\b|\bsession\s+#?\d+\b"
        r"|\b(?:first|second|third|\w+teenth|\w+tieth|\w+ieth)\s+session\b", re.IGNORECASE),
    # a figure tied to the machine it was measured on
    "host timing": re.compile(
        r"\b(?:on|with|of)\s+(?:the|this|a|our)\s+(?:\d+-core\s+)?(?:CPU|GPU|host|box|machine|device)\b"
        r"[^\n]{0,80}?\d(?:[\d,.]*\d)?\s?" + _UNIT + r"(?![\w/])"
        r"|\bmeasured\b[^\n]{0,60}?\d(?:[\d,.]*\d)?\s?" + _UNIT + r"(?![\w/])"
        r"|\b\d+-core\s+(?:CPU|machine|host|box)\b", re.IGNORECASE),
    # a throughput is a measurement of some machine (link rates in Gbps are settings, and are not matched)
    "throughput": re.compile(r"\d(?:[\d,.]*\d)?\s?(?:[GMT]i?B/s)(?![\w/])"),
}

# (path relative to the repository, or a folder ending in "/", pattern name) -> why the hit is not a lab note.
ALLOWED: dict[tuple[str, str], str] = {
    ("kvtide/cli.py", "result path"): "help text naming where the bench suites write, not a cited result",
    ("kvtide/benchmarks/", "result path"): "the suites' default output paths (they write there, cite nothing)",
}


def _allowed(rel: str, name: str) -> bool:
    return any(n == name and (rel == p or (p.endswith("/") and rel.startswith(p))) for p, n in ALLOWED)


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in SUFFIXES and p.is_file())


def _hits(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        for name, pat in PATTERNS.items():
            m = pat.search(line)
            if m and not _allowed(rel, name):
                out.append(f"{rel}:{n}: {name}: {m.group(0)!r}")
    return out


def test_sources_found() -> None:
    files = _sources()
    assert any(p.name == "__init__.py" for p in files) and len(files) > 20, files


def test_no_lab_notes_in_code() -> None:
    hits = [h for p in _sources() for h in _hits(p)]
    assert not hits, "lab notes in kvtide/ (move figures to docs/benchmarks.md, the why to docs/design/):\n" + \
        "\n".join(hits)


@pytest.mark.parametrize("text", [
    "see bench/results/zip_engine_h200.json",
    "(HISTORY.md, run 12)",
    "on the H200 it ties",
    "an RTX 4090",
    "restore A/B of 2026-11-30",
    "4 runs of each, alternated",
    "the twentieth session",
    "on the 2-core CPU ~6 ms of SmolLM2's ~45 ms",
    "measured 1.2x faster",
    "topped out at 5.5 GB/s on two threads",
])
def test_patterns_catch_lab_notes(text: str) -> None:
    assert any(p.search(text) for p in PATTERNS.values()), text


@pytest.mark.parametrize("text", [
    "if major < 9:  # sm_90 (Hopper) needs the TMA path",
    "timeout_s: float = 0.5  # a tier that does not answer in this time is down",
    "for run in runs:",
    "x = torch.zeros(2, 100, device=dev)",
    "bandwidth_gbps: float = 40.0",
    "head_dim 128, page 16 tokens",
    "'%Y-%m-%d'",
    "bandwidth_gbps: 10/40/80 Gbps links",
    "def load_gbps(self) -> float:  # bytes/s",
])
def test_patterns_spare_code(text: str) -> None:
    assert not any(p.search(text) for p in PATTERNS.values()), text
