"""``kvtide bench serve-soak``: a bounded soak of ``kvtide serve`` under load with hostile requests mixed in.

Starts the server (its own process, a free loopback port), measures its saturation (rate inf at
``--max-concurrency``), then for ``--duration`` seconds sends Poisson traffic at ``--load`` of that request rate,
``--hostile-fraction`` of it malformed or hostile (:mod:`.hostile`). Reports every status, the 5xx answers other
than 503 (a correct server has none), requests stuck past their timeout or left running in the server after the
end, and the server's RSS over time (flat after warm-up in a server that frees what it admits). SIGTERM at the end
must drain and exit 0.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


from .client import RequestResult, stream_completion
from .datasets import random_requests
from .header import machine_header
from .hostile import KINDS, Target, send_hostile
from .procs import RESULTS_DIR, free_port, json_safe, rss_mb, wait_ready
from .serve import run_rate
from .summary import summarize
from ..extras import require

httpx = require("httpx", "bench", "kvtide bench serve")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtide bench serve-soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve-args", default="smollm2-135m",
                    help="arguments of `kvtide serve` (quoted; host/port are set here) (default %(default)s)")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of soak traffic (default %(default)s)")
    ap.add_argument("--load", type=float, default=0.8, help="fraction of the saturation request rate")
    ap.add_argument("--rate", type=float, help="request rate to use instead of measuring saturation")
    ap.add_argument("--hostile-fraction", type=float, default=0.05)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=64, help="of the saturation run (default %(default)s)")
    ap.add_argument("--saturation-prompts", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take before it is stuck")
    ap.add_argument("--warmup-fraction", type=float, default=0.2,
                    help="the first part of the soak not used for the RSS trend (default %(default)s)")
    ap.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS_DIR / "serve_soak.json"))
    return ap


def _gauges(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in ("kvtide:num_requests_running", "kvtide:num_requests_waiting"):
            out[fam.name.split(":")[1]] = sum(s.value for s in fam.samples)
    return out


def _slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) in MB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return 0.0 if var == 0 else 60.0 * sum((p[0] - mx) * (p[1] - my) for p in points) / var


async def _soak(a: argparse.Namespace, proc: subprocess.Popen, base: str) -> dict:
    async with httpx.AsyncClient(timeout=httpx.Timeout(a.timeout, connect=30.0),
                                 limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64)) as c:
        served = (await c.get(base + "/v1/models")).json()["data"][0]
        model, max_len = served["id"], int(served.get("max_model_len") or 8192)
        target = Target(base, model, max_len, a.max_request_bytes)
        url = base + "/v1/completions"
        if a.rate is None:
            sat, dur = await run_rate(c, url, model, random_requests(a.saturation_prompts, a.input_len, a.output_len,
                                                                     seed=a.seed + 1),
                                      math.inf, max_concurrency=a.max_concurrency)
            saturation = summarize(sat, dur)
            rate = saturation["request_throughput"] * a.load
        else:
            saturation, rate = None, a.rate
        print(f"soak: {rate:.3f} requests/s for {a.duration:.0f} s, {a.hostile_fraction:.0%} hostile", flush=True)

        rng = random.Random(a.seed)
        good: list[RequestResult] = []
        hostile: list[dict] = []
        samples: list[dict] = []
        tasks: set[asyncio.Task] = set()
        start = time.perf_counter()
        stop_sampling = asyncio.Event()

        async def sampler() -> None:
            while not stop_sampling.is_set():
                s = {"t": time.perf_counter() - start, "rss_mb": rss_mb(proc.pid)}
                try:
                    s.update(_gauges((await c.get(base + "/metrics", timeout=10)).text))
                except (httpx.HTTPError, ValueError) as e:
                    s["metrics_error"] = str(e)[:100]
                samples.append(s)
                try:
                    await asyncio.wait_for(stop_sampling.wait(), a.sample_every)
                except asyncio.TimeoutError:
                    pass

        async def good_one(i: int) -> None:
            req = random_requests(1, a.input_len, a.output_len, seed=a.seed * 1_000_003 + i + 17)[0]
            try:
                res = await asyncio.wait_for(stream_completion(c, url, model, req), a.timeout)
            except asyncio.TimeoutError:
                res = RequestResult(len(req.prompt), req.output_len, error="stuck: no answer within the timeout")
            res.send_s = time.perf_counter() - start
            good.append(res)

        async def hostile_one(kind: str, seed: int) -> None:
            t0 = time.perf_counter()
            try:
                status, err = await asyncio.wait_for(send_hostile(c, target, kind, random.Random(seed)), a.timeout)
            except asyncio.TimeoutError:
                status, err = None, "stuck: no answer within the timeout"
            hostile.append({"kind": kind, "status": status, "error": err, "seconds": time.perf_counter() - t0,
                            "expected": status in KINDS[kind][1]})

        sampling = asyncio.ensure_future(sampler())
        kinds = sorted(KINDS)
        i, t_next = 0, 0.0
        while True:
            t_next += rng.expovariate(rate)
            if t_next > a.duration:
                break
            delay = start + t_next - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if rng.random() < a.hostile_fraction:
                coro = hostile_one(kinds[i % len(kinds)] if rng.random() < 0.5 else rng.choice(kinds), i)
            else:
                coro = good_one(i)
            i += 1
            task = asyncio.ensure_future(coro)
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(set(tasks), timeout=a.timeout + 10)
        soak_end = time.perf_counter() - start
        # what the server still holds once every client is done: it must reach 0
        left = {}
        deadline = time.perf_counter() + 60
        while time.perf_counter() < deadline:
            left = _gauges((await c.get(base + "/metrics")).text)
            if not left.get("num_requests_running") and not left.get("num_requests_waiting"):
                break
            await asyncio.sleep(1)
        stop_sampling.set()
        await sampling

    statuses: dict[str, int] = {}
    for r in good:
        statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
    for h in hostile:
        statuses[str(h["status"])] = statuses.get(str(h["status"]), 0) + 1
    fivexx = sum(n for s, n in statuses.items() if s.isdigit() and 500 <= int(s) < 600 and s != "503")
    stuck = sum(1 for r in good if r.error.startswith("stuck")) + sum(1 for h in hostile
                                                                      if h["error"].startswith("stuck"))
    by_kind: dict[str, dict] = {}
    for h in hostile:
        k = by_kind.setdefault(h["kind"], {"sent": 0, "statuses": {}, "unexpected": 0})
        k["sent"] += 1
        k["statuses"][str(h["status"])] = k["statuses"].get(str(h["status"]), 0) + 1
        k["unexpected"] += 0 if h["expected"] else 1
    warm = a.warmup_fraction * soak_end
    trend = [(s["t"], s["rss_mb"]) for s in samples if s["t"] >= warm and s.get("rss_mb")]
    return {
        "target_rate": rate, "saturation": saturation, "soak_seconds": soak_end,
        "requests": len(good) + len(hostile), "good": summarize(good, soak_end), "hostile_sent": len(hostile),
        "hostile_by_kind": by_kind, "hostile_unexpected": sum(k["unexpected"] for k in by_kind.values()),
        "statuses": statuses, "5xx_not_503": fivexx, "stuck": stuck,
        "left_in_server": left,
        "rss_mb": {"after_warmup": trend[0][1] if trend else None, "end": trend[-1][1] if trend else None,
                   "max": max((p[1] for p in trend), default=None), "slope_mb_per_min": _slope_per_min(trend)},
        "samples": samples,
    }


def plot(doc: dict, png: Path) -> None:
    """The server's RSS and its running requests over the soak."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] for s in doc["samples"]]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(t, [s.get("rss_mb") for s in doc["samples"]], "-", label="server RSS (MB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS (MB)")
    ax2 = ax.twinx()
    ax2.plot(t, [s.get("num_requests_running") for s in doc["samples"]], ":", color="gray", label="running")
    ax2.set_ylabel("requests running")
    ax.set_title(f"serve soak: {doc['requests']} requests, {doc['hostile_sent']} hostile, "
                 f"{doc['5xx_not_503']} 5xx (not 503), {doc['stuck']} stuck")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not 0 <= a.hostile_fraction < 1 or not 0 < a.load <= 1 or a.duration <= 0:
        raise ValueError("--hostile-fraction must be in [0, 1), --load in (0, 1], --duration > 0")
    port = free_port()
    args = shlex.split(a.serve_args)
    a.max_request_bytes = 1 << 20
    if "--max-request-bytes" in args:
        a.max_request_bytes = int(args[args.index("--max-request-bytes") + 1])
    cmd = [sys.executable, "-c", "from kvtide.cli import main; raise SystemExit(main())", "serve", *args,
           "--host", "127.0.0.1", "--port", str(port)]
    log_path = Path(a.out).with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as server_log:
        proc = subprocess.Popen(cmd, stdout=server_log, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, base, 300, log_path)
            res = asyncio.run(_soak(a, proc, base))
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            res["exit_code"] = proc.wait(timeout=120)
            res["shutdown_seconds"] = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
    out = {"header": machine_header(argv), "serve_args": a.serve_args, **res}
    Path(a.out).write_text(json.dumps(json_safe(out), indent=1) + "\n")
    try:
        plot(out, Path(a.out).with_suffix(".png"))
    except ImportError:
        pass
    log_path.unlink(missing_ok=True) if res["exit_code"] == 0 else None
    ok = res["5xx_not_503"] == 0 and res["stuck"] == 0 and res["exit_code"] == 0 \
        and not res["left_in_server"].get("num_requests_running")
    print(f"requests {res['requests']} (hostile {res['hostile_sent']}, unexpected statuses "
          f"{res['hostile_unexpected']}), 5xx other than 503: {res['5xx_not_503']}, stuck: {res['stuck']}, "
          f"RSS after warm-up {res['rss_mb']['after_warmup']} MB -> end {res['rss_mb']['end']} MB "
          f"(slope {res['rss_mb']['slope_mb_per_min']:.2f} MB/min), exit {res['exit_code']}; wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
