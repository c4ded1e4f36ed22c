"""Optional dependencies: which pip extra brings each one, and the error that names the install command.

The core install (`pip install kvtide`) runs the engine on a CPU; GPU kernels, transfer codecs, Redis, the server
and the benchmarks come with extras (`pyproject.toml`). A module that needs one calls `require` where it imports
it, so a missing extra fails with ``pip install 'kvtide[EXTRA]'`` instead of a bare ModuleNotFoundError.
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> the import names it provides (distribution names differ: prometheus_client is prometheus-client, ...)
EXTRAS: dict[str, tuple[str, ...]] = {
    "gpu": ("triton", "flashinfer"),
    "transfer": ("botorch", "gpytorch", "constriction", "zstandard", "lz4"),
    "redis": ("redis",),
    "serve": ("fastapi", "uvicorn", "prometheus_client", "starlette", "anyio", "httpx"),
    "bench": ("matplotlib", "httpx"),
    "hf": ("transformers", "accelerate"),
    "pd": ("mooncake",),  # the Mooncake Transfer Engine (also needs apt-get install libibverbs1)
}


class MissingExtra(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the pip command that installs its extra."""

    def __init__(self, module: str, extra: str, purpose: str | None = None):
        what = f"{purpose} needs" if purpose else "kvtide needs"
        super().__init__(f"{what} the '{module}' package: pip install 'kvtide[{extra}]'", name=module)
        self.extra = extra


def require(module: str, extra: str, purpose: str | None = None) -> ModuleType:
    """Import ``module`` (dotted names work: ``"lz4.frame"``) or raise `MissingExtra` naming ``extra``.

    Only the module itself (or its top-level package) being absent becomes `MissingExtra`; a module that is
    installed but fails inside its own imports raises as it would without this helper."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r} (known: {', '.join(EXTRAS)})")
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name is None or not (e.name == module or e.name == top or module.startswith(e.name + ".")):
            raise
        raise MissingExtra(top, extra, purpose) from e


def require_extra(extra: str, purpose: str | None = None) -> None:
    """Raise `MissingExtra` unless every module of ``extra`` is installed (looked up, not imported)."""
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a finder that refuses it, a half-imported module
            found = False
        if not found:
            raise MissingExtra(module, extra, purpose)
