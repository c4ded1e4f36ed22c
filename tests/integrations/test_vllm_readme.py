"""The README's vLLM example runs as written in real vLLM (its store moved to a temporary directory, its
``model_dir`` the converted SmolLM2), with the connector loaded and answering lookups."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integrations import vllm_env
from tests.test_readme import VLLM_BLOCKS

pytestmark = pytest.mark.slow


def test_readme_vllm_example_runs(vllm_python: Path, hf_model: Path, tmp_path: Path) -> None:
    (code,) = VLLM_BLOCKS
    assert '"disk:/var/kv"' in code
    code = code.replace('"disk:/var/kv"', repr(f"disk:{tmp_path / 'kv'}"))
    script = (f"model_dir = {str(hf_model)!r}\n{code}\n"
              "from kvtide.integrations.vllm import process_totals\n"
              "print('TOTALS ' + __import__('json').dumps(process_totals()))\n")
    r = subprocess.run([str(vllm_python), "-c", script], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=vllm_env.scenario_env())
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.strip().splitlines()
    totals = json.loads(next(ln for ln in lines if ln.startswith("TOTALS "))[len("TOTALS "):])
    text = [ln for ln in lines if not ln.startswith("TOTALS ")]
    assert text and text[-1].strip(), r.stdout  # the example prints its completion
    assert totals.get("lookups", 0) >= 1, totals  # the connector ran in vLLM's scheduler
