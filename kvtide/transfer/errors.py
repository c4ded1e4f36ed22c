"""Exceptions of the transfer layer; one class per failure a caller may want to catch apart."""
from __future__ import annotations


class SpecError(ValueError):
    """A pipeline spec string (or a stage parameter) is malformed or out of range."""


class ContainerError(ValueError):
    """A blob is damaged, truncated, foreign, or of an unsupported version.

    Raised instead of returning garbage: callers fall back to recompute and count it.
    """
