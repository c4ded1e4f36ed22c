"""Carry a real-KV capture (``bench/zip_attention.py --capture``, bf16 safetensors) to the GPU host in less room:
the header, then the low and the high byte of every 16-bit value as two planes, xz-compressed apart. The high bytes
(sign and most of the exponent) compress about 3x, the low bytes hardly at all; together 23.8 MB against 25.6 MB
for xz of the whole file, which kept the device's working tree (tracked files + FlashInfer wheels + this) under
its 64 MiB. ``join`` rebuilds the file byte for byte and prints its SHA-1.

    python bench/tools/kv_planes.py split bench/data/real_kv.safetensors   # -> .hdr, .lo.xz, .hi.xz beside it
    python bench/tools/kv_planes.py join bench/data/real_kv.safetensors    # from those three (on the GPU host)
"""
from __future__ import annotations

import argparse
import hashlib
import lzma
from pathlib import Path

import numpy as np


def split(path: Path) -> None:
    raw = path.read_bytes()
    head = 8 + int.from_bytes(raw[:8], "little")
    body = np.frombuffer(raw[head:], dtype=np.uint8)
    if body.size % 2:
        raise SystemExit(f"{path}: the tensor bytes are not 16-bit values (odd length {body.size})")
    path.with_suffix(".hdr").write_bytes(raw[:head])
    for name, plane in (("lo", body[0::2]), ("hi", body[1::2])):
        path.with_suffix(f".{name}.xz").write_bytes(lzma.compress(plane.tobytes(), preset=6))
    print(f"{path}: {len(raw)} bytes -> header {head}, planes "
          f"{path.with_suffix('.lo.xz').stat().st_size} + {path.with_suffix('.hi.xz').stat().st_size}")


def join(path: Path) -> None:
    lo, hi = (np.frombuffer(lzma.decompress(path.with_suffix(f".{n}.xz").read_bytes()), dtype=np.uint8)
              for n in ("lo", "hi"))
    if lo.size != hi.size:
        raise SystemExit(f"{path}: the byte planes differ in length ({lo.size} vs {hi.size})")
    body = np.empty(2 * lo.size, dtype=np.uint8)
    body[0::2], body[1::2] = lo, hi
    data = path.with_suffix(".hdr").read_bytes() + body.tobytes()
    path.write_bytes(data)
    print(f"{path}: {len(data)} bytes, sha1 {hashlib.sha1(data).hexdigest()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("split", "join"))
    ap.add_argument("path", type=Path)
    a = ap.parse_args()
    (split if a.what == "split" else join)(a.path)


if __name__ == "__main__":
    main()
