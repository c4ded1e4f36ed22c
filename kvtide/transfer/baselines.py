"""Published methods expressed as specs of the same pipeline space, so they run through the same code."""
from __future__ import annotations

# BF16 as is: the no-compression reference every decision is measured against.
BF16 = "none|none|none"
# CacheGen-like: token delta against anchors, fewer bits for deeper layers, arithmetic (here rANS) coding.
CACHEGEN = "delta:a=16|layer:b=6/4/3,g=64|ans"
# KIVI 2-bit: keys per channel, values per token, 32-token groups, 32 recent tokens in BF16, bit-packed.
KIVI_2BIT = "none|kivi:k=2,v=2,g=32,r=32|pack"
# DuoAttention-like press: half the heads (lowest scores) keep only 4 sink + 64 recent tokens, rest BF16.
DUO_PRESS = "none|mixhq:hi=16,lo=0,frac=0.5,sink=4,win=64|none"
# The lossless resident format reused on the wire.
ZIPFUSION = "none|none|zipf"

BASELINES: dict[str, str] = {
    "bf16": BF16,
    "cachegen": CACHEGEN,
    "kivi-2bit": KIVI_2BIT,
    "duo-press": DUO_PRESS,
    "zipfusion": ZIPFUSION,
}
