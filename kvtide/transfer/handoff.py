"""Per-layer KV hand-off over a `Transport`: the sender encodes and writes, the receiver checks and decodes.

A request's KV crosses one layer at a time: the sender encodes layer i+1 (its pipeline, straight into registered
staging memory) while layer i is on the wire, and after each write sends a ``LayerNotice`` (offset, length,
digest) on a control stream; the receiver decodes each layer as its notice arrives, so compression, transfer and
decompression overlap (KVServe's JCT with the three stages pipelined, not summed). Layers are written back to
back into one receive buffer.

The receiver trusts nothing: notices must come in layer order, tile the buffer from offset 0 without gaps or
overlap, stay inside it; each layer's bytes must match their digest, decode under a value bound with the spec the
stream announced (a lossy spec where the receiver asked for lossless is refused), and come out with the expected
shape and dtype. Any failure is a ``HandoffError``; what was decoded before it is kept by the caller's sink, which
must not use a partial request.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from .container import MAX_VALUES
from .errors import ContainerError, SpecError
from .pipeline import Pipeline
from .transport.base import LocalBuffer, RemoteBuffer, Transport, TransportError

# a layer's blob may exceed its raw size by this much (container header, incompressible streams)
BLOB_SLACK = 1.05
BLOB_HEADROOM = 64 << 10


class HandoffError(Exception):
    """A hand-off that cannot be used; ``reason`` is a metrics label (transport, timeout, corrupt, refused)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def capacity(raw_layer_bytes: int, num_layers: int) -> int:
    """Receive-buffer bytes for ``num_layers`` layers of ``raw_layer_bytes`` each (blob growth bounded)."""
    return num_layers * layer_capacity(raw_layer_bytes)


def layer_capacity(raw_layer_bytes: int) -> int:
    return int(math.ceil(raw_layer_bytes * BLOB_SLACK)) + BLOB_HEADROOM


def codec_device(pipeline: Pipeline, device: torch.device | str | None) -> torch.device | None:
    """Where a hand-off with ``pipeline`` encodes and decodes on an instance whose engine runs on ``device``: its
    GPU for every pipeline that computes there (transforms, quantizers, the nvCOMP codecs), None (the host) for
    BF16 as is and for lossless pipelines whose codec runs on the host, which would only cross the bus twice."""
    if device is None or torch.device(device).type != "cuda":
        return None
    if pipeline.lossless and (pipeline.codec.name == "none" or not pipeline.codec.device_encode):
        return None
    return torch.device(device)


def digest(data: Any) -> str:
    return xxhash.xxh64(data).hexdigest()


@dataclass(frozen=True)
class LayerNotice:
    """One written layer: where its blob lies in the receive buffer and what it hashes to."""

    layer: int
    offset: int
    nbytes: int
    digest: str
    encode_s: float = 0.0
    write_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.layer, "offset": self.offset, "nbytes": self.nbytes, "digest": self.digest,
                "encode_s": self.encode_s, "write_s": self.write_s}

    @classmethod
    def from_dict(cls, d: Any) -> "LayerNotice":
        if not isinstance(d, dict):
            raise HandoffError("corrupt", f"a layer notice must be an object, got {type(d).__name__}")
        vals = []
        for name in ("layer", "offset", "nbytes"):
            v = d.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HandoffError("corrupt", f"layer notice field {name!r} must be an integer >= 0, got {v!r}")
            vals.append(v)
        h = d.get("digest")
        if not isinstance(h, str) or len(h) != 16:
            raise HandoffError("corrupt", f"layer notice field 'digest' must be 16 hex digits, got {h!r}")
        times = []
        for name in ("encode_s", "write_s"):
            v = d.get(name, 0.0)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise HandoffError("corrupt", f"layer notice field {name!r} must be seconds >= 0, got {v!r}")
            times.append(float(v))
        return cls(*vals, h, *times)


@dataclass
class SendResult:
    profile: str
    spec: str
    layers: int
    raw_bytes: int
    wire_bytes: int
    encode_s: float  # summed over layers
    write_s: float  # summed over layers (the wire, paced)
    total_s: float  # first encode to last write (the overlapped span)
    wire_span_s: float = 0.0  # first write's start to the last one's end (GoodputMeter.observe_transfer)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def send_layers(read_layer: Callable[[int], torch.Tensor], num_layers: int, pipeline: Pipeline, profile: str,
                transport: Transport, staging: Sequence[LocalBuffer], dst: RemoteBuffer, *,
                timeout_s: float = 30.0) -> Iterator[LayerNotice | SendResult]:
    """Encode ``read_layer(i)`` ([2, tokens, kv_heads, head_dim] BF16) for every layer and write each blob after
    the previous one in ``dst``; yields a notice per written layer, then the ``SendResult``.

    A worker thread encodes each layer straight into a free ``staging`` buffer (each must hold the largest blob,
    ``layer_capacity``) while the caller's thread writes the one before it: with two buffers, encoding layer i+1
    overlaps the wire time of layer i, and no layer's blob is allocated or copied again."""
    if not staging:
        raise ValueError("send_layers needs at least one staging buffer")
    free: queue.Queue = queue.Queue()
    for b in staging:
        free.put(b)
    q: queue.Queue = queue.Queue()
    stop = threading.Event()

    def take_free() -> LocalBuffer | None:
        while not stop.is_set():
            try:
                return free.get(timeout=0.1)
            except queue.Empty:
                continue
        return None

    def encode() -> None:
        for i in range(num_layers):
            buf = take_free()
            if buf is None:
                return
            try:
                t0 = time.perf_counter()
                kv = read_layer(i).unsqueeze(0)
                try:
                    n = pipeline.encode_into(kv, buf.array)
                except ValueError as e:
                    raise HandoffError("refused", f"layer {i} does not fit the staging buffer "
                                                  f"({buf.nbytes} bytes): {e}") from None
                item: Any = (i, buf, n, kv.numel() * kv.element_size(), time.perf_counter() - t0)
            except Exception as e:  # noqa: BLE001 - reported to the writing side, which ends the stream
                item = e
            q.put(item)
            if isinstance(item, Exception):
                return

    worker = threading.Thread(target=encode, name="kvtide-encode", daemon=True)
    t_start = time.perf_counter()
    worker.start()
    offset = raw = 0
    enc_s = wr_s = 0.0
    wire_start = wire_end = 0.0
    try:
        for _ in range(num_layers):
            try:
                item = q.get(timeout=timeout_s)
            except queue.Empty:
                raise HandoffError("timeout", f"encoding a layer took over {timeout_s} s") from None
            if isinstance(item, HandoffError):
                raise item
            if isinstance(item, Exception):
                raise HandoffError("encode", f"encoding failed: {type(item).__name__}: {item}") from item
            i, buf, n, nraw, e_s = item
            if offset + n > dst.nbytes:
                raise HandoffError("refused", f"layer {i} encodes to {n} bytes: past the receive buffer "
                                              f"({dst.nbytes - offset} left)")
            h = digest(memoryview(buf.array)[:n])
            t0 = time.perf_counter()
            try:
                transport.write(buf, 0, dst, offset, n, timeout_s=timeout_s)
            except TransportError as e:
                raise HandoffError("transport", f"writing layer {i} failed: {e}") from e
            wire_end = time.perf_counter()
            wire_start = wire_start or t0
            w_s = wire_end - t0
            free.put(buf)
            yield LayerNotice(i, offset, n, h, e_s, w_s)
            offset += n
            raw += nraw
            enc_s += e_s
            wr_s += w_s
        yield SendResult(profile, pipeline.to_spec(), num_layers, raw, offset, enc_s, wr_s,
                         time.perf_counter() - t_start, wire_end - wire_start)
    finally:
        stop.set()
        worker.join(timeout=timeout_s)


@dataclass
class ReceiveResult:
    layers: int
    wire_bytes: int
    decode_s: float


def check_spec(spec: str, lossless_only: bool) -> Pipeline:
    """The pipeline of a spec a sender announced; HandoffError if it does not parse or is lossy where lossless
    was asked for."""
    try:
        p = Pipeline(spec)
    except (SpecError, ValueError, TypeError) as e:
        raise HandoffError("refused", f"the sender's spec {spec[:120]!r} is not a pipeline: {e}") from None
    if lossless_only and not p.lossless:
        raise HandoffError("refused", f"the sender chose lossy {p.to_spec()!r} where lossless KV was asked for")
    return p


def receive_layers(notices: Iterable[Any], buf: LocalBuffer, pipeline: Pipeline, num_layers: int,
                   layer_shape: tuple[int, ...], sink: Callable[[int, torch.Tensor], None],
                   device: torch.device | str | None = None) -> ReceiveResult:
    """Check and decode each noticed layer of ``buf`` into ``sink(layer, kv [2, tokens, kv_heads, head_dim])``
    (a CPU tensor), in layer order. ``notices`` yields dicts (parsed here) or LayerNotice; it must yield exactly
    ``num_layers`` of them. Decoding of layer i overlaps the wait for notice i+1 (a worker thread); ``device``:
    where to decode (a GPU runs the GPU codecs; None: the CPU)."""
    on_host = device is None or torch.device(device).type == "cpu"
    values = 1
    for s in layer_shape:
        values *= s
    if values > MAX_VALUES:
        raise HandoffError("refused", f"a layer of {values} values is past the decoder's bound {MAX_VALUES}")
    expect = (1, *layer_shape)
    q: queue.Queue = queue.Queue()
    errors: list[BaseException] = []
    decode_s = [0.0]

    def decode() -> None:
        while True:
            item = q.get()
            if item is None or errors:
                return
            i, blob = item
            try:
                t0 = time.perf_counter()
                kv = pipeline.decode(blob, max_values=values, device=None if on_host else device)
                if not isinstance(kv, torch.Tensor) or tuple(kv.shape) != expect or kv.dtype != torch.bfloat16:
                    got = tuple(kv.shape) if isinstance(kv, torch.Tensor) else type(kv).__name__
                    raise HandoffError("corrupt", f"layer {i} decoded to {got}, expected {expect} bfloat16")
                sink(i, kv[0] if on_host else kv[0].cpu())
                decode_s[0] += time.perf_counter() - t0
            except HandoffError as e:
                errors.append(e)
            except ContainerError as e:
                errors.append(HandoffError("corrupt", f"layer {i} does not decode: {e}"))
            except Exception as e:  # noqa: BLE001 - the sink's own failure ends this hand-off only
                errors.append(HandoffError("corrupt", f"layer {i}: {type(e).__name__}: {e}"))

    worker = threading.Thread(target=decode, name="kvtide-decode", daemon=True)
    worker.start()
    offset = 0
    seen = 0
    try:
        for raw in notices:
            if errors:
                break
            n = raw if isinstance(raw, LayerNotice) else LayerNotice.from_dict(raw)
            if n.layer != seen:
                raise HandoffError("corrupt", f"notice for layer {n.layer} where layer {seen} was next")
            if n.offset != offset or n.offset + n.nbytes > buf.nbytes or n.nbytes == 0:
                raise HandoffError("corrupt", f"layer {n.layer}: bytes [{n.offset}, {n.offset + n.nbytes}) are not "
                                              f"the next span of the {buf.nbytes}-byte buffer (at {offset})")
            blob = memoryview(buf.array)[n.offset:n.offset + n.nbytes]  # the buffer outlives the decoder thread
            if digest(blob) != n.digest:
                raise HandoffError("corrupt", f"layer {n.layer}: its {n.nbytes} bytes do not match their digest")
            q.put((n.layer, blob))
            offset += n.nbytes
            seen += 1
            if seen == num_layers:
                break
        if seen != num_layers and not errors:
            raise HandoffError("transport", f"the stream ended after {seen} of {num_layers} layers")
    finally:
        q.put(None)
        worker.join()
    if errors:
        raise errors[0]
    return ReceiveResult(seen, offset, decode_s[0])
