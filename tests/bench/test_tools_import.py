"""bench/tools/: every diagnostic script still imports from where it now lives (its paths to the repository, to
bench/ and to its neighbours), in one child process, none of them run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "bench" / "tools"

_IMPORT_ALL = r"""
import importlib.util, json, sys, traceback
from pathlib import Path
tools = Path(sys.argv[1])
sys.path.insert(0, str(tools))  # as when run as `python bench/tools/NAME.py`
bad = {}
for path in sorted(tools.glob("*.py")):
    try:
        spec = importlib.util.spec_from_file_location(f"bench_tool_{path.stem}", path)
        mod = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except BaseException:
        bad[path.name] = traceback.format_exc()[-800:]
print("RESULT" + json.dumps(bad))
"""


def test_every_tool_imports_from_bench_tools() -> None:
    assert len(list(TOOLS.glob("*.py"))) >= 10
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(TOOLS)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    bad = json.loads(r.stdout.rsplit("RESULT", 1)[1])
    assert not bad, "\n\n".join(f"{k}:\n{v}" for k, v in bad.items())
