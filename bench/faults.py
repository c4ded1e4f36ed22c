"""A bounded fault soak (CPU, bundled model): mixed requests while faults are injected at random.

Two engines share the process, each restoring prefixes from its own remote tier: one from a Redis server this bench
starts (and stalls with SIGSTOP, kills and restarts), one from a disk tier on a small tmpfs (filled up to ENOSPC for
a while). Both tiers' entries are corrupted, truncated, forged (another chunk's KV under a valid plain digest, the
right key, layer and tokens) and swapped at random; poison requests (tiny temperatures, invalid values, prompts
beyond the context window) and streams aborted mid-way are mixed in. Every completed output is compared with the
fault-free reference (each prompt alone, no store), on prompts whose greedy tokens win by a clear margin in fp32
transformers, so that other batch shapes cannot flip them. Reports faults injected per kind, requests served, wrong
outputs, stuck requests, crashes, max step time and peak RSS. Goal: 0 wrong, 0 stuck, 0 crashes, max step time under
3x the store timeout.

    python bench/faults.py                    # 10 minutes
    python bench/faults.py --minutes 1 --out /tmp/faults.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import report  # noqa: E402
from kvtide import LLM, SamplingParams  # noqa: E402
from kvtide.config import CacheConfig, RestoreConfig, SchedulerConfig  # noqa: E402
from kvtide.store.keys import ChunkKey  # noqa: E402
from kvtide.store.record import HEADER_BYTES, encode_record  # noqa: E402

SECRET = "faults-bench-secret"
MAX_TOKENS = 6
STUCK_S = 90.0  # a request not finished this long after it was submitted is stuck
PREFIXES = [
    "The history of the printing press begins in the fifteenth century, when movable type made books cheaper "
    "and faster to produce than ever before. Within fifty years presses were running in most European cities, and "
    "the number of books in circulation grew from thousands to millions. ",
    "A hash table stores key and value pairs in an array of buckets. A hash function maps each key to a bucket, "
    "and collisions are resolved by chaining or by open addressing. With a good hash function lookups take constant "
    "time on average, which is why hash tables are everywhere in software. ",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, chlorophyll "
    "absorbs light, water is split, oxygen is released, and the energy is stored in sugar molecules that the plant "
    "uses to grow. Nearly all life on Earth depends on this process. ",
]
SUFFIXES = ["Question: what is this text about? Answer:", "Summary in one sentence:", "The main point is",
            "In other words,", "A good title for this would be", "Here is a question about it:",
            "Key words:", "The next paragraph says that"]


# ---- processes and mounts this bench owns ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    """A redis-server of this bench only, on loopback; stopped, continued and killed by its own pid."""

    def __init__(self, workdir: Path):
        self.exe = shutil.which("redis-server")
        if self.exe is None:
            raise SystemExit("bench/faults.py needs redis-server (apt-get install redis-server)")
        self.port, self.workdir, self.proc = free_port(), workdir, None
        self.stopped = False
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def sigstop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def sigcont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.stopped = False

    def kill(self) -> None:
        if self.stopped:
            self.sigcont()
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)


class SmallDisk:
    """A tmpfs of ``size_mb`` (root, mount allowed), else a plain directory (then ``full`` cannot be injected)."""

    def __init__(self, size_mb: int):
        self.path = Path(tempfile.mkdtemp(prefix="kvtide-faults-disk-"))
        self.mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(self.path)],
                                      capture_output=True).returncode == 0
        self.filler = self.path / "filler"

    def fill(self) -> None:
        with open(self.filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass

    def unfill(self) -> None:
        self.filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", str(self.path)], capture_output=True)
        shutil.rmtree(self.path, ignore_errors=True)


# ---- references ------------------------------------------------------------------------------------------------
def stable_prompts(llm: LLM, prompts: list[str], min_margin: float) -> dict[str, list[int]]:
    """Greedy tokens of each prompt run alone (no store), kept where every token wins by ``min_margin`` logits in
    transformers' fp32 forward of the same weights (near-ties flip with the batch's shape: see tests/engine)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_dir, dtype=torch.float32).eval()
    g = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for p in prompts:
        toks = llm.generate(p, g)[0].token_ids
        ids = llm.tokenizer.encode(p) + toks
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, len(ids) - len(toks) - 1:-1]
        top = logits.topk(2, dim=-1).values
        if float((top[:, 0] - top[:, 1]).min()) >= min_margin and logits.argmax(-1).tolist() == toks:
            out[p] = toks
    del hf
    return out


# ---- the soak ---------------------------------------------------------------------------------------------------
class Soak:
    def __init__(self, args, engines: dict[str, LLM], reference: dict[str, list[int]], redis: Redis,
                 disk: SmallDisk):
        self.args, self.engines, self.ref, self.redis, self.disk = args, engines, reference, redis, disk
        self.rng = random.Random(args.seed)
        self.prompts = sorted(reference)
        self.deadline = time.monotonic() + args.minutes * 60
        self.lock = threading.Lock()
        self.faults: Counter[str] = Counter()
        self.skipped: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.wrong: list[dict] = []
        self.crashes: list[str] = []
        self.inflight: dict[int, tuple[str, float]] = {}
        self.stuck: set[int] = set()
        self.step_max: dict[str, float] = {}
        self._ids = iter(range(1 << 62))
        for name, llm in engines.items():
            self._time_steps(name, llm)

    def _time_steps(self, name: str, llm: LLM) -> None:
        eng, real = llm.engine, llm.engine.step
        self.step_max[name] = 0.0

        def step():
            t0 = time.perf_counter()
            try:
                return real()
            finally:
                dt = time.perf_counter() - t0
                if dt > self.step_max[name]:
                    self.step_max[name] = dt

        eng.step = step

    def alive(self) -> bool:
        return time.monotonic() < self.deadline and self.requests["submitted"] < self.args.max_requests

    # ---- callers
    def caller(self, seed: int) -> None:
        rng = random.Random(seed)
        while self.alive():
            try:
                self._one_request(rng)
            except Exception as e:  # noqa: BLE001 - counted as a crash of the bench's view of the engine
                with self.lock:
                    self.crashes.append(f"{type(e).__name__}: {e}")

    def _one_request(self, rng: random.Random) -> None:
        name = rng.choice(sorted(self.engines))
        llm = self.engines[name]
        kind = rng.choices(["generate", "stream_abort", "poison_temp", "poison_invalid"], [70, 15, 10, 5])[0]
        prompt = rng.choice(self.prompts)
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        if kind == "poison_invalid":
            bad = rng.choice([dict(prompt=[10**9]), dict(prompt=""), dict(prompt=[1] * (llm.engine.max_seq_len + 1))])
            try:
                llm.loop.submit(bad["prompt"], greedy)
            except (ValueError, TypeError):
                with self.lock:
                    self.requests["rejected_as_expected"] += 1
                    self.faults["poison_invalid"] += 1
            else:
                with self.lock:
                    self.wrong.append({"kind": kind, "why": "an invalid request was accepted"})
            return
        params = greedy
        if kind == "poison_temp":
            params = SamplingParams(temperature=rng.choice([1e-300, 5e-324, 1e-12]), max_tokens=MAX_TOKENS,
                                    ignore_eos=True, seed=rng.randrange(1000))
        rid = next(self._ids)
        with self.lock:
            self.requests["submitted"] += 1
            self.inflight[rid] = (name, time.monotonic())
            if kind == "poison_temp":
                self.faults["poison_temperature"] += 1
        try:
            handle = llm.loop.submit(prompt, params)
            if kind == "stream_abort":
                stop_after = rng.randrange(1, MAX_TOKENS)
                got: list[int] = []
                for out in handle:
                    got += out.new_token_ids
                    if len(got) >= stop_after:
                        handle.abort()
                        break
                with self.lock:
                    self.faults["stream_aborted"] += 1
                    self.requests["aborted"] += 1
                    if got != self.ref[prompt][:len(got)]:
                        self.wrong.append({"engine": name, "kind": kind, "prompt": prompt, "got": got,
                                           "want": self.ref[prompt][:len(got)]})
                return
            out = handle.result()
            with self.lock:
                if out.finish_reason == "error":
                    self.requests["errors"] += 1
                    self.wrong.append({"engine": name, "kind": kind, "prompt": prompt, "error": out.error})
                    return
                self.requests["served"] += 1
                self.requests["cached_tokens"] += out.num_cached_tokens
                if out.token_ids != self.ref[prompt]:
                    self.wrong.append({"engine": name, "kind": kind, "prompt": prompt, "got": out.token_ids,
                                       "want": self.ref[prompt]})
        finally:
            with self.lock:
                self.inflight.pop(rid, None)

    def watchdog(self) -> None:
        while self.alive() or self.inflight:
            now = time.monotonic()
            with self.lock:
                for rid, (_, t0) in self.inflight.items():
                    if now - t0 > STUCK_S:
                        self.stuck.add(rid)
            if not self.alive() and now > self.deadline + 2 * STUCK_S:
                return
            time.sleep(1.0)

    # ---- faults
    def injector(self) -> None:
        kinds = ["corrupt", "truncate", "forge", "swap", "redis_stall", "redis_kill", "disk_full"]
        weights = [20, 15, 20, 15, 12, 6, 12]
        while self.alive():
            time.sleep(self.rng.uniform(0.5, 2.0) * self.args.fault_interval)
            if not self.alive():
                return
            kind = self.rng.choices(kinds, weights)[0]
            try:
                done = getattr(self, "_" + kind)()
            except Exception as e:  # noqa: BLE001 - the bench's own tooling failed (e.g. Redis mid-restart)
                done = False
                print(f"fault {kind} not injected: {type(e).__name__}: {e}", file=sys.stderr)
            with self.lock:
                (self.faults if done else self.skipped)[kind] += 1

    def _entries(self, tier: str) -> list[tuple[str, object]]:
        """(entry name, handle) of the tier's entries: a path (disk) or a Redis key."""
        if tier == "disk":
            return [(p.name[:-4], p) for p in (self.disk.path / "store").glob("*/*.kvt")]
        if self.redis.stopped:
            return []
        r = self.redis.client()
        return [(k.decode()[len("kvf:"):], k) for k in r.scan_iter(match=b"kvf:*", count=1000)]

    def _get(self, tier: str, h) -> bytes:
        return Path(h).read_bytes() if tier == "disk" else self.redis.client().get(h)

    def _set(self, tier: str, h, blob: bytes) -> None:
        if tier == "disk":
            Path(h).write_bytes(blob)
        else:
            self.redis.client().set(h, blob)

    def _pick(self, n: int = 1):
        tier = self.rng.choice(["disk", "redis"])
        entries = self._entries(tier)
        if len(entries) < n:
            return None
        return tier, self.rng.sample(entries, n)

    def _corrupt(self) -> bool:
        got = self._pick()
        if got is None:
            return False
        tier, [(_, h)] = got
        blob = bytearray(self._get(tier, h) or b"")
        if not blob:
            return False
        for _ in range(self.rng.randint(1, 8)):
            i = self.rng.randrange(len(blob))
            blob[i] ^= 1 << self.rng.randrange(8)
        self._set(tier, h, bytes(blob))
        return True

    def _truncate(self) -> bool:
        got = self._pick()
        if got is None:
            return False
        tier, [(_, h)] = got
        blob = self._get(tier, h) or b""
        self._set(tier, h, blob[:self.rng.randrange(len(blob))] if blob else b"")
        return True

    def _swap(self) -> bool:
        got = self._pick(2)
        if got is None:
            return False
        tier, [(_, a), (_, b)] = got
        ba, bb = self._get(tier, a), self._get(tier, b)
        if ba is None or bb is None or ba == bb:
            return False
        self._set(tier, a, bb)
        self._set(tier, b, ba)
        return True

    def _forge(self) -> bool:
        """Another chunk's KV in this entry's record, with this entry's key, layer and tokens, and a valid plain
        (unkeyed) digest: what a writer without the secret could make."""
        got = self._pick(2)
        if got is None:
            return False
        tier, [(name, a), (_, b)] = got
        ra, rb = self._get(tier, a), self._get(tier, b)
        if ra is None or rb is None:
            return False
        ma, mb = _meta(ra), _meta(rb)
        if ma is None or mb is None or ma[0]["shape"] != mb[0]["shape"]:
            return False
        meta, tokens, _ = ma
        kv = mb[2]
        forged = encode_record(ChunkKey(meta["key"], 0), meta["layer"], tokens, kv)
        self._set(tier, a, bytes(forged))
        return True

    def _redis_stall(self) -> bool:
        if self.redis.stopped or self.redis.proc.poll() is not None:
            return False
        self.redis.sigstop()
        time.sleep(self.rng.uniform(1.0, 4.0))
        self.redis.sigcont()
        return True

    def _redis_kill(self) -> bool:
        if self.redis.stopped:
            return False
        self.redis.kill()
        time.sleep(self.rng.uniform(2.0, 6.0))
        self.redis.start()
        return True

    def _disk_full(self) -> bool:
        if not self.disk.mounted:
            return False
        self.disk.fill()
        time.sleep(self.rng.uniform(2.0, 6.0))
        self.disk.unfill()
        return True


def _meta(blob: bytes):
    """(metadata, token ids, KV tensor) of a plain-payload record with clear token ids, or None."""
    import struct

    if len(blob) < HEADER_BYTES:
        return None
    _, _, flags, meta_len, _, _ = struct.unpack_from("<4sHHIQ16s", blob)
    try:
        meta = json.loads(blob[HEADER_BYTES:HEADER_BYTES + meta_len])
    except ValueError:
        return None
    if flags & 2 or meta.get("codec") or meta.get("dtype") != "bfloat16":
        return None
    off = HEADER_BYTES + meta_len
    n = meta["num_tokens"]
    tokens = list(memoryview(blob[off:off + 4 * n]).cast("I"))
    kv = torch.frombuffer(bytearray(blob[off + 4 * n:]), dtype=torch.bfloat16)
    if kv.numel() != torch.Size(meta["shape"]).numel():
        return None
    return meta, tokens, kv.reshape(meta["shape"])


def draw(doc: dict, plt):
    """Headline figure: faults injected per kind and requests per outcome, the goal's verdict in the title."""
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    faults = doc.get("faults", {})
    a0.barh(list(faults), list(faults.values()))
    a0.set_xlabel("faults injected")
    req = {k: v for k, v in doc.get("requests", {}).items() if "token" not in k}  # counts of requests only
    outcome = {**req, "wrong outputs": doc.get("wrong_outputs", 0), "stuck": doc.get("stuck_requests", 0),
               "crashes": doc.get("crashes", 0)}
    bars = a1.barh(list(outcome), list(outcome.values()), color=["C0"] * len(req) + ["C3"] * 3)
    a1.bar_label(bars, fontsize=8)
    a1.set_xlabel("requests")
    steps = doc.get("max_step_s", {})
    fig.suptitle(f"fault soak, {doc.get('duration_s', 0):.0f} s: goal {'met' if doc.get('goal_met') else 'NOT met'}; "
                 f"max step {max(steps.values(), default=0):.2f} s (goal < {doc.get('max_step_goal_s')} s)",
                 fontsize=10)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-requests", type=int, default=100_000)
    ap.add_argument("--callers", type=int, default=4, help="threads submitting requests")
    ap.add_argument("--fault-interval", type=float, default=2.0, help="mean seconds between injected faults")
    ap.add_argument("--timeout", type=float, default=0.5, help="RestoreConfig.store_timeout_s")
    ap.add_argument("--min-margin", type=float, default=0.05)
    ap.add_argument("--num-pages", type=int, default=40, help="device KV pages per engine (small: prefixes are "
                    "evicted and restored from the tiers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/faults_cpu.json"))
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    work = Path(tempfile.mkdtemp(prefix="kvtide-faults-"))
    redis, disk = Redis(work), SmallDisk(24)
    t_start = time.time()
    try:
        sched = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
        common = dict(chunk_tokens=32, secret=SECRET, store_timeout_s=args.timeout, breaker_failures=3,
                      breaker_backoff_s=3.0, lookup_budget_s=args.timeout / 2, max_batch=2, flush_timeout_s=2.0)
        prompts = [p + s for p in PREFIXES for s in SUFFIXES]
        plain = LLM("smollm2-135m", progress=False, scheduler=sched)
        reference = stable_prompts(plain, prompts, args.min_margin)
        del plain
        if len(reference) < 4:
            raise SystemExit(f"only {len(reference)} prompts with a clear greedy margin; lower --min-margin")
        # a device cache of a few prompts' pages: prefixes fall out of it and come back from the tiers
        cache = CacheConfig(num_pages=args.num_pages)
        engines = {
            "redis": LLM("smollm2-135m", progress=False, scheduler=sched, cache=cache,
                         restore=RestoreConfig(store=f"redis://127.0.0.1:{redis.port}/0?prefix=kvf:", **common)),
            "disk": LLM("smollm2-135m", progress=False, scheduler=sched, cache=cache,
                        restore=RestoreConfig(store=f"disk:{disk.path / 'store'}?capacity=16M", **common)),
        }
        for llm in engines.values():
            llm.loop.start()
        soak = Soak(args, engines, reference, redis, disk)
        callers = [threading.Thread(target=soak.caller, args=(args.seed * 100 + i,), daemon=True)
                   for i in range(args.callers)]
        threads = callers + [threading.Thread(target=soak.injector, daemon=True),
                    threading.Thread(target=soak.watchdog, daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.minutes * 60 + 3 * STUCK_S)
        hung = sum(t.is_alive() for t in callers)  # a caller still waiting on its request
        for llm in engines.values():
            if not llm.loop.running:
                soak.crashes.append("an engine loop is not running")
            llm.loop.stop(timeout=30)
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        result = {
            "bench": "faults", "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python":
                platform.python_version(), "torch": torch.__version__, "model": "smollm2-135m (bundled, real weights)",
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t_start)),
            "duration_s": round(time.time() - t_start, 1),
            "settings": {**vars(args), "chunk_tokens": 32, "max_tokens": MAX_TOKENS, "prompts": len(reference),
                         "disk_tmpfs": disk.mounted},
            "faults": dict(soak.faults), "faults_not_injected": dict(soak.skipped),
            "requests": dict(soak.requests),
            "wrong_outputs": len(soak.wrong), "wrong_examples": soak.wrong[:5],
            "stuck_requests": max(len(soak.stuck), hung),
            "crashes": len(soak.crashes), "crash_examples": soak.crashes[:5],
            "max_step_s": {k: round(v, 3) for k, v in soak.step_max.items()},
            "max_step_goal_s": 3 * args.timeout,
            "peak_rss_mb": round(rss_mb, 1),
            "restore": {k: {f: getattr(llm.engine.restorer.stats, f) for f in
                            ("restorations", "requests", "restored_tokens", "loaded_tokens", "load_failures",
                             "fallbacks", "fallback_tokens", "writes_dropped", "errors")
                            if hasattr(llm.engine.restorer.stats, f)}
                        for k, llm in engines.items()},
            "store": {k: _store_counters(llm) for k, llm in engines.items()},
        }
        result["goal_met"] = (result["wrong_outputs"] == 0 and result["stuck_requests"] == 0
                              and result["crashes"] == 0
                              and max(result["max_step_s"].values()) < result["max_step_goal_s"])
        report.write(args.out, result, draw, argv)
        print(json.dumps({k: result[k] for k in ("faults", "requests", "wrong_outputs", "stuck_requests", "crashes",
                                                 "max_step_s", "peak_rss_mb", "goal_met")}, indent=1))
        for llm in engines.values():
            llm.engine.restorer.close()
    finally:
        redis.close()
        disk.close()
        shutil.rmtree(work, ignore_errors=True)


def _store_counters(llm: LLM) -> dict:
    store = llm.engine.restorer.store
    seen, out = set(), {}
    while store is not None and id(store) not in seen:  # wrappers (breaker, bandwidth) around the tier
        seen.add(id(store))
        stats = getattr(store, "stats", None)
        if stats is not None and hasattr(stats, "snapshot"):
            out.update({k: v for k, v in stats.snapshot().items() if v})
        br = getattr(store, "breaker", None)
        if br is not None and hasattr(br, "stats"):
            snap = br.stats.snapshot() if hasattr(br.stats, "snapshot") else vars(br.stats)
            out.update({f"breaker_{k}": v for k, v in snap.items() if isinstance(v, (int, float)) and v})
        store = getattr(store, "inner", None) or getattr(store, "store", None)
    return out


if __name__ == "__main__":
    main()
