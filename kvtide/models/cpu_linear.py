"""Linear layers through oneDNN with weights packed once, for float32 models on the CPU.

torch's CPU `F.linear` goes to MKL, which on some x86 CPUs (AMD's among them) runs the engine's small-M GEMMs far
below what oneDNN reaches with a weight packed for it; the packed weight is made once at load. Results differ from
MKL's only in float32 summation order.
"""
from __future__ import annotations

import torch
from torch import nn

from ..log import get_logger

log = get_logger("models")


def onednn_available() -> bool:
    """Whether this torch has oneDNN's packed linear ops (CPU builds with MKL-DNN)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """``nn.Linear``'s forward over a oneDNN-packed copy of its weight. The packed copy replaces the layer (no
    second copy of the weights is kept); a weight tied to another module (the embedding) stays there."""

    def __init__(self, linear: nn.Linear, batch_hint: int = 64):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(w, batch_hint))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self.packed, self.bias, "none", [], "")
        return out.reshape(*shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Replace every float32 CPU ``nn.Linear`` in ``model`` by a `PackedLinear`; returns how many. A no-op (0)
    where oneDNN's ops are missing."""
    if not onednn_available():
        log.info("oneDNN packed linear ops unavailable: CPU linears stay on torch's default GEMM")
        return 0
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.device.type == "cpu" \
                    and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
