"""Whether Triton kernels run in its interpreter (``TRITON_INTERPRET=1``: CPU tensors, tests only). One reading of
the setting for every kernel module and backend; triton itself reads it when a kernel is first decorated."""
from __future__ import annotations

import os


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
