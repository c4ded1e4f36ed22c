"""Chained prefix-chunk keys."""

from __future__ import annotations

import pytest

from kvtide.store.keys import KeySpace, chunk_keys, chunk_tokens

SP = KeySpace("smollm2-135m", 4, "bfloat16")


def test_only_full_chunks_and_chained() -> None:
    ks = chunk_keys(list(range(11)), SP)
    assert [k.index for k in ks] == [0, 1]
    assert len({k.hex for k in ks}) == 2


def test_shared_prefix_shares_keys_then_diverges() -> None:
    a = chunk_keys([1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9], SP)
    b = chunk_keys([1, 2, 3, 4, 5, 6, 7, 8, 0, 9, 9, 9], SP)
    assert a[:2] == b[:2] and a[2] != b[2]


def test_a_change_early_changes_every_later_key() -> None:
    a = chunk_keys(list(range(16)), SP)
    b = chunk_keys([99] + list(range(1, 16)), SP)
    assert all(x.hex != y.hex for x, y in zip(a, b))
    # the same chunk content at the same position after a different history is a different key
    assert a[3].hex != b[3].hex


@pytest.mark.parametrize("other", [KeySpace("other-model", 4), KeySpace("smollm2-135m", 4, "float16")])
def test_model_and_dtype_fold_into_the_root(other: KeySpace) -> None:
    assert chunk_keys(list(range(8)), SP)[0] != chunk_keys(list(range(8)), other)[0]


def test_chunk_size_folds_into_the_root() -> None:
    a = chunk_keys(list(range(8)), KeySpace("m", 8))[0]
    b = chunk_keys(list(range(8)), KeySpace("m", 4))
    assert a.hex not in {k.hex for k in b}


def test_entry_names_and_tokens() -> None:
    toks = list(range(100, 112))
    k = chunk_keys(toks, SP)[1]
    assert k.entry_name(3) == f"{k.hex}.3"
    assert chunk_tokens(toks, k, SP).tolist() == [104, 105, 106, 107]
    with pytest.raises(ValueError):
        k.entry_name(-1)


def test_validation() -> None:
    with pytest.raises(ValueError):
        KeySpace("", 4)
    with pytest.raises(ValueError):
        KeySpace("m", 0)
    with pytest.raises(ValueError):
        chunk_keys([-1, 2, 3, 4], SP)
