"""Key-side stages of the wide search space: per-channel key scaling (``kscale``), key-only rotation
(``hadamard:on=k``) and residual outlier key channels (quantizer ``o``), each against a torch reference, within
the stated error bound, and refused with a ContainerError when their container streams are malformed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtide.transfer import ContainerError, Pipeline, decode
from kvtide.transfer.errors import SpecError
from kvtide.transfer.transforms import Hadamard, KeyScale, _hadamard
from transfer_blobs import join, kv, replace_stream, split, stream_payloads

SCORES = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.4]])


def real_like(seed: int = 0) -> torch.Tensor:
    """[3, 2, 70, 2, 64] BF16 with per-channel ranges spread 15x and one large outlier key channel."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 70, 2, 64, generator=g) * (0.2 + 3 * torch.rand(1, 2, 1, 2, 64, generator=g))
    x[0, 0, :, 0, 5] += 20.0
    x[2, 0, :, 1, 40] -= 12.0
    return x.bfloat16()


def test_kscale_matches_reference_and_inverts_exactly():
    x = real_like(1).float()
    for a in (1.0, 0.5, 0.0):
        t = KeyScale(a=a)
        y, side = t.encode(x)
        amax = x[:, 0].abs().amax(1, keepdim=True)  # [L, 1, H, D]
        e = (a * torch.log2(amax)).round()
        assert torch.equal(y[:, 0], x[:, 0] / 2.0**e)
        assert torch.equal(y[:, 1], x[:, 1])
        if a == 1.0:
            assert float(y[:, 0].abs().max()) <= 2 ** 0.5 + 1e-6  # every key channel brought to about [-1, 1]
        assert torch.equal(t.decode(y, side), x)  # powers of two: exact
    p = Pipeline("kscale|none|none")  # lossless quantizer: the BF16 KV comes back bit for bit
    xb = real_like(2)
    blob = p.encode(xb)
    assert torch.equal(p.decode(blob).view(torch.int16), xb.view(torch.int16)) and p.error_bound(blob) == 0.0


def test_key_rotation_matches_reference():
    x = real_like(3).float()
    h = _hadamard(64)
    y, _ = Hadamard(on="k").encode(x)
    assert torch.allclose(y[:, 0], x[:, 0] @ h, atol=1e-5) and torch.equal(y[:, 1], x[:, 1])
    assert torch.allclose(Hadamard(on="k").decode(y, {}), x, atol=1e-5)
    with pytest.raises(SpecError, match="on must be"):
        Pipeline("hadamard:on=v|none|none")
    assert Pipeline("hadamard:on=kv|kivi|pack").to_spec() == "hadamard|kivi|pack"  # default omitted


def test_outlier_channels_reference():
    """o=4: per (layer, head) the 4 key channels of largest max |K| decode bit-exact; everything else decodes as
    the same quantizer (o=0) decodes the KV with those channels zeroed."""
    x = real_like(4)
    o = 4
    p = Pipeline(f"none|uniform:k=3,v=3,o={o}|pack")
    y = p.decode(p.encode(x))
    k = x[:, 0].float().permute(0, 2, 1, 3)  # [L, H, T, D]
    idx = torch.topk(k.abs().amax(2), o, -1).indices  # reference choice
    assert int(idx[0, 0].eq(5).sum()) == 1 and int(idx[2, 1].eq(40).sum()) == 1  # the planted outliers
    keep = torch.zeros_like(k, dtype=torch.bool).scatter(-1, idx[:, :, None, :].expand(-1, -1, k.shape[2], -1), True)
    keep = keep.permute(0, 2, 1, 3)  # [L, T, H, D]
    assert torch.equal(y[:, 0][keep].view(torch.int16), x[:, 0][keep].view(torch.int16))
    z = x.clone()
    z[:, 0][keep] = 0
    ref = Pipeline("none|uniform:k=3,v=3|pack").decode(Pipeline("none|uniform:k=3,v=3|pack").encode(z))
    assert torch.equal(y[:, 0][~keep].view(torch.int16), ref[:, 0][~keep].view(torch.int16))
    assert torch.equal(y[:, 1].view(torch.int16), ref[:, 1].view(torch.int16))
    # outliers out of the per-token groups shrink the error of the quantised rest
    base = Pipeline("none|uniform:k=3,v=3|pack")
    e0 = (base.decode(base.encode(x)).float() - x.float())[:, 0].abs().mean()
    e1 = (y.float() - x.float())[:, 0].abs().mean()
    assert e1 < 0.8 * e0, (e1, e0)


NEW_LOSSY = ["kscale|uniform:k=4,v=4|zstd", "kscale:a=0.5|kivi|ans", "hadamard:on=k|uniform:k=3,v=3|pack",
             "none|uniform:k=3,v=3,o=4|pack", "none|kivi:o=2|ans", "kscale|mixhq:o=4|zstd",
             "hadamard:on=k|layer:b=6/4/2,o=3|lz4", "affine|mixhq:hi=6,lo=0,o=1|pack", "delta|uniform:k=2,v=2,g=16,o=8|ans"]


@pytest.mark.parametrize("spec", NEW_LOSSY)
def test_new_stages_within_stated_bound(spec):
    x = real_like(5)
    p = Pipeline(spec, SCORES)
    blob = p.encode(x)
    y, mask = p.decode_with_mask(blob)
    assert torch.equal(decode(blob).view(torch.int16), y.view(torch.int16))
    err = (y.float() - x.float()).abs()
    if mask is not None:
        err = err * mask.unsqueeze(-1)
    bound = p.error_bound(blob)
    assert 0 < bound < 1e3
    assert torch.all(err <= bound + 2.0**-8 * x.float().abs() + 1e-4 * x.float().abs().max()), (err.max(), bound)


def test_outlier_count_validated():
    with pytest.raises(SpecError, match="outlier channels o"):
        Pipeline("none|uniform:o=256|pack")
    with pytest.raises(SpecError, match="head_dim"):
        Pipeline("none|uniform:o=32,g=16|pack").encode(kv())  # kv(): head_dim 32


# --- malformed containers --------------------------------------------------------------------------------------
def _edited(spec: str, fn) -> bytes:
    header, payload = split(Pipeline(spec).encode(kv()))
    parts = stream_payloads(header, payload)
    fn(header, parts)
    body = b"".join(parts.get(s["name"], b"")[: s["n"]] for s in header["entries"][0]["streams"])
    return join(header, body)


def _drop(name):
    def fn(h, parts):
        h["entries"][0]["streams"] = [s for s in h["entries"][0]["streams"] if s["name"] != name]
    return fn


def _reshape(name, shape):
    def fn(h, parts):
        next(s for s in h["entries"][0]["streams"] if s["name"] == name)["shape"] = shape
    return fn


def _add_outliers_to(h, parts):
    donor = split(Pipeline("none|uniform:k=3,v=3,g=16,o=2|none").encode(kv()))
    dparts = stream_payloads(*donor)
    for s in donor[0]["entries"][0]["streams"]:
        if s["name"].startswith("q.ko."):
            h["entries"][0]["streams"].append(s)
            parts[s["name"]] = dparts[s["name"]]


OUT = "none|uniform:k=3,v=3,g=16,o=2|none"
MALFORMED = [
    ("outlier-index-missing", OUT, _drop("q.ko.i"), "outlier streams"),
    ("outlier-values-missing", OUT, _drop("q.ko.k"), "outlier streams"),
    ("outlier-streams-unasked", "none|uniform:k=3,v=3,g=16|none", _add_outliers_to, "quantizer streams|outlier"),
    ("outlier-index-shape", OUT, _reshape("q.ko.i", [2, 2, 3]), "stream 'q.ko.i'"),
    ("outlier-values-shape", OUT, _reshape("q.ko.k", [2, 2, 24, 3]), "stream 'q.ko.k'"),
    ("kscale-missing", "kscale|uniform:k=3,v=3,g=16|none", _drop("t.e"), "side streams"),
    ("kscale-shape", "kscale|uniform:k=3,v=3,g=16|none", _reshape("t.e", [2, 2, 1, 2, 32]), "stream 't.e'"),
]


@pytest.mark.parametrize("spec,fn,match", [c[1:] for c in MALFORMED], ids=[c[0] for c in MALFORMED])
def test_malformed_streams_rejected(spec, fn, match):
    with pytest.raises(ContainerError, match=match):
        Pipeline(spec).decode(_edited(spec, fn))


def test_outlier_index_out_of_range_rejected():
    blob = Pipeline(OUT).encode(kv())
    bad = replace_stream(blob, "q.ko.i", bytes([200]) * (2 * 2 * 2))
    with pytest.raises(ContainerError, match="outlier channel index 200"):
        decode(bad)


def test_kscale_exponent_out_of_range_rejected():
    spec = "kscale|uniform:k=3,v=3,g=16|none"
    blob = Pipeline(spec).encode(kv())
    bad = replace_stream(blob, "t.e", np.full(2 * 2 * 32, 255, np.uint8).tobytes())
    with pytest.raises(ContainerError, match="kscale exponent"):
        decode(bad)
    with pytest.raises(ContainerError, match="kscale exponent"):
        Pipeline(spec).error_bound(bad)
