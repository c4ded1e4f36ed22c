"""Scenarios against real vLLM, run by the tests in vLLM's own venv (``python vllm_scenarios.py SPEC.json``).

One vLLM engine per run (a start costs ~30 s on two cores), then the spec's phases in order; the last line of
stdout is a JSON object with each phase's result. Phases: ``generate`` (greedy tokens of a prompt set, and the
connector's counters it moved), ``flush`` (queued saves written), ``reset`` (vLLM's prefix cache emptied, so the
next prompts must come from the store or be computed), ``damage`` (corrupt / truncate / forge one stored entry of
a chunk of each named document, on a disk store), ``kill`` (end a process by its pid: the Redis server the test
started), ``layout`` (vLLM's CPU kernel writes K/V of a prompt; the connector's layout must read the same values
back), ``metrics`` (vLLM's Prometheus metrics of the connector, and vLLM's own count of external prefix-cache hits).
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pydoc_data.topics as topics
import torch

DOCS = {"assignment": "assignment", "class": "class", "import": "import", "calls": "calls"}
QUESTIONS = ["What does this text explain first?", "Name one rule it states."]


def prompts(names: list[str], tokenizer, doc_tokens: int) -> list[dict]:
    """Token-id prompts: the first ``doc_tokens`` tokens of a Python documentation topic, then a question."""
    out = []
    for name in names:
        doc, q = name.split("/") if "/" in name else (name, "0")
        ids = tokenizer.encode(topics.topics[DOCS[doc]])[:doc_tokens]
        tail = tokenizer.encode(f"\n\nQuestion: {QUESTIONS[int(q)]}\nAnswer:", add_special_tokens=False)
        out.append({"prompt_token_ids": ids + tail})
    return out


def build_llm(spec: dict):
    from vllm import LLM

    kw = dict(enforce_eager=True, max_model_len=4096, seed=0, disable_log_stats=not spec.get("log_stats", False))
    if spec.get("connector") is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtideConnector", kv_connector_module_path="kvtide.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=spec["connector"])
    return LLM(spec["model"], **kw)


def totals() -> dict:
    from kvtide.integrations.vllm import process_totals

    return process_totals()


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] - before.get(k, 0)}


def entry_path(root: Path, key_hex: str, layer: int) -> Path:
    hits = list(root.rglob(f"{key_hex}.{layer}.kvt"))
    if not hits:
        raise FileNotFoundError(f"no stored entry {key_hex}.{layer} under {root}")
    return hits[0]


def damage(llm, spec: dict, phase: dict) -> dict:
    """One entry of one chunk of each document, damaged the named way; returns what was done."""
    from kvtide.store.auth import RecordAuth
    from kvtide.store.keys import chunk_keys
    from kvtide.store.record import decode_record, encode_record
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    root = Path(spec["connector"]["store"].split(":", 1)[1])
    tok = llm.get_tokenizer()
    done = []
    for (doc, how), layer in zip(phase["what"].items(), (3, 7, 11, 15)):
        ids = prompts([doc], tok, spec["doc_tokens"])[0]["prompt_token_ids"]
        key = chunk_keys(ids, conn.keyspace)[phase.get("chunk", 0)]
        path = entry_path(root, key.hex, layer)
        blob = bytearray(path.read_bytes())
        if how == "corrupt":
            blob[len(blob) // 2] ^= 0x40
        elif how == "truncate":
            blob = blob[: len(blob) - 1000]
        elif how == "forge":  # a well-formed record of the same KV, signed with another secret
            n = spec["connector"]["chunk_tokens"]
            toks = ids[key.index * n:(key.index + 1) * n]
            store = conn.worker.store
            auth = getattr(store, "auth", None) or getattr(getattr(store, "inner", None), "auth", None)
            kv = decode_record(bytes(blob), key, layer, toks, auth=auth)
            blob = bytearray(encode_record(key, layer, toks, kv, auth=RecordAuth(b"someone else")).tobytes())
        else:
            raise ValueError(how)
        path.write_bytes(bytes(blob))
        done.append({"doc": doc, "how": how, "layer": layer, "chunk": key.index})
    return {"damaged": done}


def layout_probe(llm, spec: dict) -> dict:
    """K/V as vLLM's CPU kernel receives them for one prompt, against what the connector's layout reads back."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.v1.attention.backends import cpu_attn

    from kvtide.integrations.vllm.layout import get_layout

    seen: dict = {}
    impl = cpu_attn.CPUAttentionBackendImpl
    orig = impl.do_kv_cache_update

    def spy(self, layer, key, value, kv_cache, slot_mapping):
        if "kv" not in seen and kv_cache.data_ptr() == first.data_ptr():
            seen["kv"] = (key.clone(), value.clone(), slot_mapping.clone())
        return orig(self, layer, key, value, kv_cache, slot_mapping)

    conn = get_kv_transfer_group()
    first = conn.worker.caches[0]
    impl.do_kv_cache_update = spy
    try:
        from vllm import SamplingParams

        llm.reset_prefix_cache()
        llm.generate(prompts(["class/1"], llm.get_tokenizer(), 300), SamplingParams(temperature=0, max_tokens=1),
                     use_tqdm=False)
    finally:
        impl.do_kv_cache_update = orig
    key, value, slot = seen["kv"]
    n = key.shape[0]
    slot = slot[:n].to(torch.int64)
    bs = conn.block_size
    back = get_layout(conn.worker.layout.name).gather(first, slot // bs, slot % bs, conn.head_dim)
    want = torch.stack((key.view(n, conn.num_kv_heads, -1), value.view(n, conn.num_kv_heads, -1)))
    return {"layout": conn.worker.layout.name, "tokens": n, "equal": bool(torch.equal(back, want.to(back.dtype))),
            "max_abs_diff": float((back.float() - want.float()).abs().max())}


def metrics(llm) -> dict:
    out = {}
    for m in llm.get_metrics():
        if "kvtide" in m.name or "external_prefix_cache" in m.name:
            out[m.name] = getattr(m, "value", None)
    return {"metrics": out}


def main(path: str) -> None:
    spec = json.loads(Path(path).read_text())
    from vllm import SamplingParams

    llm = build_llm(spec)
    tok = llm.get_tokenizer()
    sp = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 24))
    results = []
    for phase in spec["phases"]:
        op = phase["op"]
        before = totals() if spec.get("connector") is not None else {}
        res: dict = {"op": op}
        if op == "generate":
            outs = llm.generate(prompts(phase["prompts"], tok, spec["doc_tokens"]), sp, use_tqdm=False)
            res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
            res["text"] = [o.outputs[0].text for o in outs]
        elif op == "flush":
            from kvtide.integrations.vllm import flush_saves

            res["flushed"] = flush_saves(phase.get("timeout", 60))
        elif op == "reset":
            res["reset"] = bool(llm.reset_prefix_cache())
        elif op == "damage":
            res.update(damage(llm, spec, phase))
        elif op == "kill":
            os.kill(int(phase["pid"]), signal.SIGKILL)
        elif op == "layout":
            res.update(layout_probe(llm, spec))
        elif op == "metrics":
            res.update(metrics(llm))
        else:
            raise ValueError(f"unknown phase {op!r}")
        if spec.get("connector") is not None:
            res["counts"] = delta(totals(), before)
        results.append(res)
    if spec.get("connector") is not None:
        from kvtide.integrations.vllm import flush_saves

        flush_saves(60)  # the next process reads what this one wrote
    print(json.dumps({"phases": results}))
    sys.stdout.flush()
    os._exit(0)  # vLLM's engine threads can hold a normal exit for a long time


if __name__ == "__main__":
    main(sys.argv[1])
