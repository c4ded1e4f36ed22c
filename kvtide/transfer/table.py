"""Profile table files: the 3D Pareto set the profiler writes and the controller loads."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .controller import Profile

TABLE_VERSION = 1


def _num(v: float) -> Any:
    return "inf" if math.isinf(v) else v


def save_profiles(path: str | Path, profiles: Sequence[Profile], extra: Mapping[str, Mapping[str, Any]] | None = None,
                  **info: Any) -> None:
    """Atomic write of ``{"version", "info", "profiles": [...]}``; infinities as the string "inf".
    ``extra[name]``: further fields of that profile (e.g. its quality interval), which ``load_profiles`` ignores."""
    extra = extra or {}
    doc = {"version": TABLE_VERSION, "info": info, "profiles": [
        {"name": p.name, "ratio": p.ratio, "encode_throughput": _num(p.encode_throughput),
         "decode_throughput": _num(p.decode_throughput), "quality": p.quality, **extra.get(p.name, {})}
        for p in profiles]}
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def load_profiles(path: str | Path) -> list[Profile]:
    doc = json.loads(Path(path).read_text())
    if doc.get("version") != TABLE_VERSION:
        raise ValueError(f"{path}: profile table version {doc.get('version')!r}, expected {TABLE_VERSION}")
    return [Profile(d["name"], float(d["ratio"]), float(d["encode_throughput"]), float(d["decode_throughput"]),
                    float(d["quality"])) for d in doc["profiles"]]
