"""bench/results/ holds exactly the files docs/benchmarks.md cites: each file there is cited, each cited path exists;
and the page's `kvtide bench` commands parse with their suites' options."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.cli_parse import parse_only

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"
CITED = re.compile(r"bench/results/[A-Za-z0-9_.\-/]*[A-Za-z0-9_\-]")


def cited_paths() -> set[str]:
    return set(CITED.findall(BENCHMARKS.read_text()))


def result_files() -> set[str]:
    """Files under bench/results/, less the git-ignored run folders `kvtide bench gpu` writes (gpu-<date>/)."""
    files = (p.relative_to(RESULTS) for p in RESULTS.rglob("*") if p.is_file())
    return {(RESULTS / f).relative_to(ROOT).as_posix() for f in files
            if not (len(f.parts) > 1 and f.parts[0].startswith("gpu-"))}


def test_every_result_file_is_cited():
    uncited = sorted(result_files() - cited_paths())
    assert not uncited, f"files under bench/results/ that docs/benchmarks.md does not cite (cite or remove): {uncited}"


def test_every_cited_result_exists():
    missing = sorted(cited_paths() - result_files())
    assert not missing, f"docs/benchmarks.md cites files that are not under bench/results/: {missing}"


def test_benchmarks_cite_something():
    assert len(cited_paths()) >= 10  # the pattern still matches how the page writes paths


def bench_commands() -> list[str]:
    """The page's `kvtide bench ...` commands (placeholders like <older commit> left out)."""
    return sorted(set(re.findall(r"`(kvtide bench [^`<]*)`", BENCHMARKS.read_text())))


@pytest.mark.parametrize("cmd", bench_commands())
def test_bench_command_parses(cmd, monkeypatch):
    parse_only(shlex.split(cmd)[1:], monkeypatch)


@pytest.mark.parametrize("script", sorted(set(re.findall(r"`python (bench/[\w/.-]+\.py)", BENCHMARKS.read_text()))))
def test_named_script_exists(script):
    assert (ROOT / script).is_file(), script
