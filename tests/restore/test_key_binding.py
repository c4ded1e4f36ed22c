"""Keys bind stored KV to what made it: weights changed behind the same path, another compute dtype or another
namespace restore nothing of each other's entries (0 restored tokens) and give the output of a run without a store.
Weights are fingerprinted by content, once per file version (cached under the kvtide cache directory)."""
from __future__ import annotations

import dataclasses
import gc
import json
import shutil
from pathlib import Path

import pytest
import torch

from kvtide import CacheConfig
from kvtide.config import RestoreConfig
from kvtide.engine.llm import LLM
from kvtide.models import fingerprint as fp
from kvtide.models.llama import ModelArgs
from kvtide.models.loader import build_model, resolve_model_dir
from kvtide.store import KeySpace, MemoryStore, chunk_keys
from tests.restore.restore_helpers import greedy, no_restore, text_ids

CHUNK = 32


def engine(model: str, store: MemoryStore, **restore: object) -> LLM:
    dtype = restore.pop("dtype", "float32")
    llm = LLM(model, progress=False, dtype=dtype, cache=CacheConfig(kv_dtype="float32"),
              restore=RestoreConfig(chunk_tokens=CHUNK, **restore))
    llm.engine.restorer.use_store(store)
    return llm


def close(llm: LLM) -> None:
    llm.engine.restorer.close()
    del llm
    gc.collect()


def prompts(llm: LLM) -> tuple[list[int], list[int]]:
    a = text_ids(llm, 5200, 80)
    return a, a + text_ids(llm, 9100, 10)


def write_turn(llm: LLM, a: list[int]) -> None:
    llm.generate(a, greedy(2))
    llm.engine.restorer.writer.flush()


def restores_nothing(llm: LLM, b: list[int]) -> None:
    """``b`` finds none of the store's chunks and decodes exactly as without a store."""
    out = llm.generate(b, greedy(3))[0]
    st = llm.engine.restorer.stats
    assert st.restorations == 0 and st.restored_tokens == 0 and out.num_cached_tokens == 0
    with no_restore(llm):
        assert out.token_ids == llm.generate(b, greedy(3))[0].token_ids


@pytest.fixture(scope="module")
def smol_store():
    """SmolLM2 (fp32 compute, no namespace) wrote turn 1 to the store; a second engine of the same config restores
    from it (the keys do match when nothing changed: the cases below are not vacuous)."""
    store = MemoryStore(256 << 20)
    llm = engine("smollm2-135m", store)
    a, b = prompts(llm)
    write_turn(llm, a)
    close(llm)
    same = engine("smollm2-135m", store)
    out = same.generate(b, greedy(3))[0]
    assert same.engine.restorer.stats.restored_tokens >= 2 * CHUNK and out.num_cached_tokens >= 2 * CHUNK
    close(same)
    return store, b


@pytest.mark.parametrize("change", [{"dtype": "bfloat16"}, {"namespace": "tenant-b"}])
def test_another_compute_dtype_or_namespace_restores_nothing(smol_store, change: dict) -> None:
    store, b = smol_store
    llm = engine("smollm2-135m", store, **change)
    try:
        restores_nothing(llm, b)
    finally:
        close(llm)


TINY = ModelArgs(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                 vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def write_tiny(d: Path, seed: int) -> None:
    """A Hugging Face-style directory: the tiny model's config, seeded random weights, SmolLM2's tokenizer."""
    from safetensors.torch import save_file

    d.mkdir(exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": TINY.hidden_size,
           "intermediate_size": TINY.intermediate_size, "num_hidden_layers": TINY.num_layers,
           "num_attention_heads": TINY.num_heads, "num_key_value_heads": TINY.num_kv_heads,
           "head_dim": TINY.head_dim, "vocab_size": TINY.vocab_size, "tie_word_embeddings": True,
           "max_position_embeddings": TINY.max_position_embeddings, "rms_norm_eps": 1e-5}
    (d / "config.json").write_text(json.dumps(cfg))
    src = resolve_model_dir("smollm2-135m", progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, d / name)
    sd = build_model(TINY, None, "cpu", torch.float32, seed=seed).state_dict()
    sd.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))


def test_weights_changed_behind_the_same_path_restore_nothing(tmp_path: Path) -> None:
    d = tmp_path / "tiny"
    write_tiny(d, seed=1)
    store = MemoryStore(64 << 20)
    old = engine(str(d), store)
    a, b = prompts(old)
    write_turn(old, a)
    out = old.generate(b, greedy(3))[0]
    assert out.num_cached_tokens >= 2 * CHUNK  # same weights: restored
    close(old)
    write_tiny(d, seed=2)  # same path, same size, other content
    new = engine(str(d), store)
    try:
        restores_nothing(new, b)
    finally:
        close(new)


# ---- fingerprints and key roots ---------------------------------------------------------------------------------


def test_file_digest_is_cached_per_file_version(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIDE_CACHE_DIR", str(tmp_path / "cache"))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 1000)
    first = fp.file_digest(f)
    assert list((tmp_path / "cache" / "fingerprints").glob("*.json"))

    def no_reads(*a, **kw):  # noqa: ANN002, ANN003
        raise AssertionError("hashed again although the file did not change")

    monkeypatch.setattr(fp, "open", no_reads, raising=False)
    assert fp.file_digest(f) == first  # from the cache
    monkeypatch.undo()
    monkeypatch.setenv("KVTIDE_CACHE_DIR", str(tmp_path / "cache"))
    f.write_bytes(b"b" * 1000)  # same size, new content
    assert fp.file_digest(f) != first


def test_fingerprints_follow_content_not_path(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVTIDE_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "model.safetensors").write_bytes(b"same weights")
    (b / "model.safetensors").write_bytes(b"same weights")
    assert fp.weights_fingerprint(str(a)) == fp.weights_fingerprint(str(b))
    (b / "model.safetensors").write_bytes(b"other weight")
    assert fp.weights_fingerprint(str(a)) != fp.weights_fingerprint(str(b))
    assert fp.weights_fingerprint("random:tiny") == fp.weights_fingerprint("random:tiny") != \
        fp.weights_fingerprint("random:tiny-d128")
    m1, m2 = (build_model(TINY, None, "cpu", torch.float32, seed=1) for _ in range(2))
    assert fp.model_fingerprint(m1) == fp.model_fingerprint(m2)
    with torch.no_grad():
        m2.model.layers[0].mlp.up_proj.weight[0, 0] += 1.0
    assert fp.model_fingerprint(m1) != fp.model_fingerprint(m2)
    assert fp.config_fingerprint(TINY) != fp.config_fingerprint(dataclasses.replace(TINY, rms_norm_eps=1e-6))


@pytest.mark.parametrize("field,value", [("weights", "w2"), ("model_config", "c2"), ("compute_dtype", "bfloat16"),
                                         ("dtype", "float16"), ("namespace", "t1"), ("salt", b"s")])
def test_every_binding_changes_the_key_root(field: str, value: object) -> None:
    base = KeySpace("m", 8, "bfloat16", weights="w1", model_config="c1", compute_dtype="float32")
    other = dataclasses.replace(base, **{field: value})
    ids = list(range(16))
    assert not {k.hex for k in chunk_keys(ids, base)} & {k.hex for k in chunk_keys(ids, other)}
    if field == "namespace":
        with pytest.raises(ValueError):
            KeySpace("m", 8, namespace="")  # no empty name that could pass for "no namespace"
