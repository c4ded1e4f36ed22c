"""The KV transport for prefill/decode disaggregation: one-sided writes into a peer's registered host buffer.

`open_transport` gives an endpoint: the Mooncake Transfer Engine (`mooncake.py`, the real one; optional extra
``pd``) or an in-process one for tests (`inproc.py`). `pacing.py` holds a sender to a set rate and measures
goodput. The design and the measured behaviour: docs/design/transport.md.
"""
from .base import (BufferFreed, LocalBuffer, PeerUnreachable, RemoteBuffer, Transport, TransportError,
                   TransportTimeout, open_transport)
from .inproc import InProcTransport
from .mooncake import MooncakeTransport, mooncake_available  # the engine itself is imported on first use
from .pacing import GoodputMeter, PacedTransport, TokenBucket

__all__ = ["BufferFreed", "LocalBuffer", "PeerUnreachable", "RemoteBuffer", "Transport", "TransportError",
           "TransportTimeout", "open_transport", "InProcTransport", "MooncakeTransport", "mooncake_available",
           "GoodputMeter", "PacedTransport", "TokenBucket"]
