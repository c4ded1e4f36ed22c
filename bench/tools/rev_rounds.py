"""This tree's ``kvtide`` against an earlier revision's, timed in alternating rounds (shared by the benches that
take ``--compare REV``: planner_speed, record_verify, zip_write_path).

REV's ``kvtide`` is checked out (``git archive``) into a temporary directory (REV may also name a directory that
holds a ``kvtide/`` already, for machines without the git history, such as the lent GPU host); each round runs
``measure(reps)`` here, then the calling script again as ``--child --reps N`` with that directory first on
``PYTHONPATH``, which must print the same dict as JSON on its last line. Alternating keeps both sides on the same
machine state.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]


def add_args(ap: argparse.ArgumentParser, what: str) -> None:
    """The flags every such bench takes (``--reps`` is the caller's: its unit differs)."""
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare", default=None, help=f"a git revision whose {what} runs alongside (child process)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)


def run(measure: Callable[[int], dict], script: str, reps: int, rounds: int,
        compare: str | None) -> dict[str, list[dict]]:
    """Per side ("this", and "compare" when REV is given), the dict of each round."""
    out: dict[str, list[dict]] = {"this": [], "compare": []}
    with tempfile.TemporaryDirectory() as tmp:
        if compare and (Path(compare) / "kvtide").is_dir():
            tmp = str(Path(compare).resolve())
        elif compare:
            arch = subprocess.run(["git", "archive", compare, "kvtide"], cwd=ROOT, check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=arch.stdout, check=True)
        for _ in range(rounds):
            out["this"].append(measure(reps))
            if compare:
                path = os.pathsep.join(filter(None, [tmp, os.environ.get("PYTHONPATH")]))
                r = subprocess.run([sys.executable, script, "--child", "--reps", str(reps)],
                                   env={**os.environ, "PYTHONPATH": path}, check=True, capture_output=True, text=True,
                                   cwd=tmp)
                out["compare"].append(json.loads(r.stdout.strip().splitlines()[-1]))
    return out


def parse_and_run(ap: argparse.ArgumentParser, measure: Callable[[int], dict], script: str
                  ) -> tuple[argparse.Namespace, dict[str, list[dict]] | None]:
    """Parse the bench's flags; as ``--child``, print this tree's ``measure(reps)`` and return (args, None), else
    (args, the rounds of ``run``) with this tree first on ``sys.path``."""
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.reps)))
        return a, None
    sys.path.insert(0, str(ROOT))
    return a, run(measure, script, a.reps, a.rounds, a.compare)


def head() -> str:
    """The short commit of this tree (the "this" side is its working tree)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def side_medians(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per side that ran, the median over its rounds of each key of ``measure``'s dict."""
    return {side: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for side, rs in rounds.items() if rs}


def meta(compare: str | None) -> dict:
    """What every such bench's JSON names: date, machine, versions, this tree and the compared revision."""
    import numpy
    import torch

    return {"when": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "numpy": numpy.__version__, "torch": torch.__version__,
            "this": head() + " (working tree)", "compare": compare}


def write(out: dict, path: str | None) -> None:
    """The bench's JSON at ``path`` (``--out``), when given."""
    if path:
        Path(path).write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
