"""The machine/versions header every benchmark JSON starts with."""
from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
import sys
from pathlib import Path


def _git_rev() -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def machine_header(argv: list[str] | None = None) -> dict:
    """Python, platform, CPU count, torch and device (where torch is importable), kvtide's git rev, date, argv."""
    head = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
            "cpu_count": os.cpu_count(), "kvtide_git": _git_rev(),
            "argv": list(sys.argv[1:] if argv is None else argv)}
    try:
        import torch

        head["torch"] = torch.__version__
        if torch.cuda.is_available():
            head["device"] = torch.cuda.get_device_name(0)
            head["cuda"] = torch.version.cuda
        else:
            head["device"] = "cpu"
    except ImportError:
        head["torch"] = None
    return head
