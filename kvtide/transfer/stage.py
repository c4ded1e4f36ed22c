"""Shared plumbing of pipeline stages: a name registry and dataclass <-> spec parameters."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from .errors import SpecError
from .spec import StageSpec, Value

S = TypeVar("S", bound="Stage")


_TORCH_DTYPES = {"uint8": "|u1", "int16": "<u2", "float16": "<f2", "float32": "<f4"}  # BF16 bits travel as int16


@dataclass(frozen=True)
class Stream:
    """One named array a stage hands to the codec: a numpy array, or a torch tensor on any device.

    ``bits`` set means integer codes in [0, 2**bits) stored as uint8 (packable, entropy-codable);
    ``bf16`` means the array holds BF16 bit patterns (uint16 in numpy, int16 in torch; ZipFusion-codable).
    A tensor's wire dtype is the numpy one it maps to, so where a stream was computed does not change the blob.
    """

    data: np.ndarray | torch.Tensor
    bits: int | None = None
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.bits is not None and (self.dtype != "|u1" or not 1 <= self.bits <= 8):
            raise ValueError(f"code streams are uint8 with 1..8 bits, got {self.data.dtype} bits={self.bits}")
        if self.bf16 and self.dtype != "<u2":
            raise ValueError("bf16 streams hold uint16 bit patterns")

    @property
    def dtype(self) -> str:
        """The numpy dtype string the stream is recorded and decoded as."""
        if isinstance(self.data, torch.Tensor):
            return _TORCH_DTYPES.get(str(self.data.dtype).removeprefix("torch."), str(self.data.dtype))
        return self.data.dtype.str

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def host(self) -> "Stream":
        """The same stream as a numpy array (a copy to the host for a device tensor)."""
        if not isinstance(self.data, torch.Tensor):
            return self
        a = self.data.detach().contiguous().cpu().numpy()
        return Stream(a.view(np.uint16) if self.dtype == "<u2" else a, self.bits, self.bf16)


class Stage:
    """A stage is a frozen dataclass whose fields are its spec parameters (with short names)."""

    name: ClassVar[str]
    registry: ClassVar[dict[str, type]]

    @classmethod
    def from_stage(cls: type[S], st: StageSpec) -> S:
        sub = cls.registry.get(st.name)
        if sub is None:
            raise SpecError(f"unknown {cls.__name__.lower()} {st.name!r}; known: {sorted(cls.registry)}")
        names = {f.name for f in dataclasses.fields(sub)}
        kwargs: dict[str, Any] = {}
        for k, v in st.params:
            if k not in names:
                raise SpecError(f"{st.name}: unknown parameter {k!r}; known: {sorted(names)}")
            kwargs[k] = v
        try:
            return sub(**kwargs)
        except SpecError:
            raise
        except (TypeError, ValueError) as e:
            raise SpecError(f"{st.name}: {e}") from e

    def to_stage(self) -> StageSpec:
        params: list[tuple[str, Value]] = []
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if f.default is not dataclasses.MISSING and v == f.default:
                continue
            params.append((f.name, v))
        return StageSpec(self.name, tuple(params))


def register(base: type) -> Any:
    """Class decorator: file a stage class under its ``name`` in ``base.registry``."""

    def deco(cls: type) -> type:
        if cls.name in base.registry:
            raise RuntimeError(f"duplicate stage {cls.name!r}")
        base.registry[cls.name] = cls
        return cls

    return deco


def check_int(name: str, v: Any, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SpecError(f"{name} must be an int in [{lo}, {hi}], got {v!r}")
