import pytest

from kvtide.transfer.baselines import BASELINES
from kvtide.transfer.errors import SpecError
from kvtide.transfer.pipeline import Pipeline
from kvtide.transfer.spec import format_spec, parse_spec

SPECS = [
    "none|none|none",
    "hadamard|kivi:k=2,v=2,g=32,r=32|zstd:l=3",
    "delta:a=8|layer:b=8/4/2,g=64|ans",
    "affine|uniform:k=3,v=5,kax=channel,g=16,r=4|lz4:l=9",
    "none|mixhq:hi=16,lo=0,frac=0.5,sink=4,win=64|pack",
    "none|mixhq:hi=8,lo=2,frac=0.125|zipf:bs=256",
    " hadamard | kivi : k = 4 | ans ",
    *BASELINES.values(),
]


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip(spec):
    p = Pipeline(spec)
    canon = p.to_spec()
    assert Pipeline.from_spec(canon) == p
    assert Pipeline(canon).to_spec() == canon
    assert format_spec(parse_spec(canon)) == canon


def test_canonical_omits_defaults_and_orders():
    assert Pipeline("none|kivi:r=32,v=2,k=2,g=32|zstd:l=3").to_spec() == "none|kivi|zstd"
    assert Pipeline("none|layer:b=4|none").to_spec() == "none|layer:b=4|none"


@pytest.mark.parametrize("bad", [
    "none|none", "none|none|none|none", "foo|none|none", "none|kivi:k=9|none", "none|kivi:q=1|none",
    "none|kivi:k|none", "none|kivi:k=2,k=3|none", "none|uniform:kax=diag|none", "none|none|zstd:l=40",
    "none|mixhq:frac=1.5|none", "none|mixhq:lo=0,hi=0|none", "none|layer:b=3/9|none", "Bad|none|none",
    "none|kivi:|none", "none|kivi:g=0|none", "none|kivi:k=2.5|none",
])
def test_bad_specs_raise(bad):
    with pytest.raises(SpecError):
        Pipeline(bad)


def test_non_str_spec():
    with pytest.raises(SpecError):
        Pipeline(3)  # type: ignore[arg-type]
