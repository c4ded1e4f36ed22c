"""`kvtide bench NAME`: every registered suite resolves, answers --help, and writes what report.write writes.

No benchmark runs here: the suites' --help runs in one child process (each suite imports its own stack once, and
the Triton kernels it may import are decorated there, not in the test process).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtide.cli import BENCH_SUITES

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
HELPERS = {"report.py", "restore_trace.py"}  # bench/ modules that the suites import, not suites themselves

_HELP_ALL = r"""
import contextlib, inspect, io, json, sys
from kvtide import cli
out = {}
for name in cli.BENCH_SUITES:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            code = cli.main(["bench", name, "--help"])
        except SystemExit as e:
            code = e.code
    mod = cli.bench_suite(name)
    params = list(inspect.signature(mod.main).parameters)
    out[name] = {"code": code, "usage": buf.getvalue()[:300], "main_takes_argv": params[:1] == ["argv"],
                 "draws": callable(getattr(mod, "draw", None))}
print("RESULT" + json.dumps(out))
"""


def test_every_suite_resolves_and_the_promised_ones_are_there() -> None:
    assert {"zip-attention", "zip-engine", "restore", "kvserve", "serve", "faults", "engine-cpu"} <= set(BENCH_SUITES)
    for name, target in BENCH_SUITES.items():
        if target.endswith(".py"):
            assert (BENCH / target).is_file(), (name, target)
        else:
            assert importlib.util.find_spec(target) is not None, (name, target)


def test_bench_holds_suites_and_tools_holds_the_rest() -> None:
    """Every script at the top of bench/ is a registered suite (or a helper they import); diagnostics live in
    bench/tools/ and none of them is registered."""
    files = {p.name for p in BENCH.glob("*.py")}
    registered = {t for t in BENCH_SUITES.values() if t.endswith(".py")}
    assert files - HELPERS == registered, files ^ registered
    tools = {p.name for p in (BENCH / "tools").glob("*.py")}
    assert tools and not tools & registered


def test_every_suite_answers_help_and_exposes_main_and_draw() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "COLUMNS": "120"}
    r = subprocess.run([sys.executable, "-c", _HELP_ALL], capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.rsplit("RESULT", 1)[1])
    assert set(got) == set(BENCH_SUITES)
    for name, g in got.items():
        assert g["code"] in (0, None), (name, g)
        assert g["usage"].startswith(f"usage: kvtide bench {name}"), (name, g["usage"])
        assert g["main_takes_argv"], f"{name}: main(argv) is what `kvtide bench` calls"
        # serve* draw their own PNGs; gpu runs other suites, which draw theirs
        assert g["draws"] or name.startswith("serve") or name == "gpu", f"{name}: draw(doc, plt) makes its PNG"


def test_report_writes_the_header_first_and_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    sys.path.insert(0, str(ROOT))
    from bench import report

    def draw(doc: dict, plt):
        fig, ax = plt.subplots()
        ax.plot(doc["xs"])
        return fig

    out = report.write(tmp_path / "r.json", {"xs": [1, 3, 2], "header": "stale"}, draw, argv=["--x", "1"])
    doc = json.loads((tmp_path / "r.json").read_text())
    assert list(doc) == ["header", "xs"] and doc == out
    head = doc["header"]
    for key in ("python", "torch", "device", "kvtide_git", "date", "argv"):
        assert key in head, key
    assert head["argv"] == ["--x", "1"]
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.write(tmp_path / "n.json", {"xs": []}, draw, png=False) and not (tmp_path / "n.png").exists()
