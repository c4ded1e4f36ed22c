"""Decompression bombs and lying symbol counts, decoded in a fresh process: each is a ContainerError, the process
survives, and its peak RSS grows by no more than a small multiple of the declared output (far below the bomb)."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtide.transfer import ContainerError, Pipeline, decode
from transfer_blobs import join, replace_stream, split

SHAPE = (4, 2, 256, 4, 64)  # 524,288 values: 1 MiB of BF16 declared
DECLARED = int(np.prod(SHAPE)) * 2
SLACK = 4 << 20  # allocator and interpreter noise around one decode attempt

CHILD = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from kvtide.transfer import ContainerError, decode
    d = Path(sys.argv[1])
    for spec in ("zstd", "lz4", "ans"):  # warm up: first-use imports and buffers are not the decoders' cost
        decode((d / f"valid-{spec}").read_bytes())
    for name in json.loads((d / "cases.json").read_text()):
        blob = (d / name).read_bytes()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            decode(blob)
            res = "decoded"
        except ContainerError as e:
            res = "ContainerError: " + str(e)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"case": name, "result": res, "grew": (after - before) * 1024}), flush=True)
""")


def _zstd_bomb(nbytes: int, declare: bool) -> bytes:
    import zstandard
    co = zstandard.ZstdCompressor(level=1).compressobj(size=nbytes if declare else -1)
    chunk = bytes(1 << 24)
    return b"".join([co.compress(chunk) for _ in range(nbytes // len(chunk))] + [co.flush()])


def _lz4_bomb(nbytes: int, declare: bool) -> bytes:
    import lz4.frame
    c = lz4.frame.LZ4FrameCompressor()
    chunk = bytes(1 << 24)
    parts = [c.begin(source_size=nbytes if declare else 0)]
    parts += [c.compress(chunk) for _ in range(nbytes // len(chunk))]
    return b"".join(parts + [c.flush()])


def _ans_claiming(blob: bytes, n: int, shape: tuple[int, ...] | None = None) -> bytes:
    """The ANS q.v stream replaced by two byte planes that claim ``n`` symbols (uniform counts), 300 words each."""
    counts = np.full(256, n // 256, np.uint32)
    counts[: n % 256] += 1
    plane = struct.pack("<II", 256, n) + counts.tobytes() + np.arange(1, 301, dtype=np.uint32).tobytes()
    out = replace_stream(blob, "q.v", (struct.pack("<I", len(plane)) + plane) * 2)
    if shape is None:
        return out
    header, payload = split(out)
    header["entries"][0]["shape"] = list(shape)
    header["entries"][0]["streams"][0]["shape"] = list(shape)
    return join(header, payload)


def test_bombs_and_counts_bounded_in_a_subprocess(tmp_path: Path):
    x = torch.zeros(SHAPE, dtype=torch.bfloat16)
    valid = {c: Pipeline(f"none|none|{c}").encode(x) for c in ("zstd", "lz4", "ans")}
    gib, quarter = 1 << 30, 1 << 28
    cases = {
        "zstd-bomb-declared": (replace_stream(valid["zstd"], "q.v", _zstd_bomb(gib, True)), gib),
        "zstd-bomb-undeclared": (replace_stream(valid["zstd"], "q.v", _zstd_bomb(gib, False)), gib),
        "lz4-bomb-declared": (replace_stream(valid["lz4"], "q.v", _lz4_bomb(quarter, True)), quarter),
        "lz4-bomb-undeclared": (replace_stream(valid["lz4"], "q.v", _lz4_bomb(quarter, False)), quarter),
        # 2^32-1 symbols: the native decoder would allocate 16 GiB (the old code was killed / aborted)
        "ans-count-2^32-1": (_ans_claiming(valid["ans"], 2**32 - 1), 4 * (2**32 - 1)),
        # a shape that agrees with the count (2^28 values) but 1.2 KB of words cannot hold them: refused unread
        "ans-count-too-few-words": (_ans_claiming(valid["ans"], 1 << 28, (64, 2, 2048, 8, 128)), 4 << 28),
    }
    for c, blob in valid.items():
        (tmp_path / f"valid-{c}").write_bytes(blob)
    for name, (blob, _) in cases.items():
        (tmp_path / name).write_bytes(blob)
        assert len(blob) < 2 << 20, (name, len(blob))  # small inputs
    (tmp_path / "cases.json").write_text(json.dumps(list(cases)))
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["case"] for row in rows] == list(cases)
    for row in rows:
        bomb = cases[row["case"]][1]
        assert row["result"].startswith("ContainerError"), row
        assert row["grew"] <= 2 * DECLARED + SLACK, row  # 6 MiB at most, against 256 MiB .. 16 GiB
        assert row["grew"] * 40 < bomb, row


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_bomb_message_names_the_sizes(codec):
    x = torch.zeros(1, 2, 16, 1, 64, dtype=torch.bfloat16)
    blob = Pipeline(f"none|none|{codec}").encode(x)
    bomb = _zstd_bomb(1 << 26, True) if codec == "zstd" else _lz4_bomb(1 << 26, True)
    msg = f"{codec}: frame declares {1 << 26} bytes, the stream's shape implies 4096"
    with pytest.raises(ContainerError, match=msg):
        decode(replace_stream(blob, "q.v", bomb))
