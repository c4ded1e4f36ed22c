"""``kvtide bench serve``: a load generator for any OpenAI-compatible server, reported as ``vllm bench serve`` does.

Requests are streamed ``/v1/completions`` with token-id prompts (exact lengths on every server), sent on a Poisson
schedule (``--request-rate``), a trace's own timing scaled to a rate, or all at once (``inf``), optionally capped
at ``--max-concurrency`` in flight. ``--sweep`` first measures saturation (rate inf) and then runs at the given
fractions of it. Writes JSON (machine header, arguments, one entry per rate) and a PNG of latency against achieved
throughput; ``--plot A.json B.json`` overlays earlier runs (kvtide and vLLM, say) in one PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path
from typing import Any


from ..log import get_logger
from .client import RequestResult, stream_completion
from .datasets import (BenchRequest, TokenRange, arrival_times, prefix_repetition_requests, random_requests,
                       trace_requests)
from .header import machine_header
from .procs import RESULTS_DIR, json_safe
from .summary import SLO, summarize
from ..extras import require

httpx = require("httpx", "bench", "kvtide bench serve")

log = get_logger("bench.serve")
DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "mooncake" / "conversation_trace.jsonl"
MAX_CONNECTIONS = 4096


def _rate(text: str) -> float:
    t = text.strip().lower()
    if t in ("inf", "infinity"):
        return math.inf
    if t == "trace":
        return math.nan
    try:
        v = float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"request rate {text!r}: expected a number > 0, 'inf' or 'trace'") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate {text!r} must be > 0")
    return v


def _rates(text: str) -> list[float]:
    return [_rate(x) for x in text.split(",") if x.strip()]


def _fractions(text: str) -> list[float]:
    out = []
    for x in text.split(","):
        v = float(x)
        if not 0 < v <= 1:
            raise argparse.ArgumentTypeError(f"sweep fraction {x!r} must be in (0, 1]")
        out.append(v)
    return out


def _token_range(text: str) -> TokenRange:
    lo, sep, hi = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"token range {text!r}: expected LO:HI")
    try:
        return TokenRange(int(lo), int(hi))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"token range {text!r}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvtide bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    ap.add_argument("--model", help="model name to send (default: the first of the server's /v1/models)")
    ap.add_argument("--label", help="name of this server in the JSON and plots (default: the model name)")
    ap.add_argument("--dataset", choices=("random", "prefix-repetition", "mooncake"), default="random")
    ap.add_argument("--num-prompts", type=int, default=200, help="requests per rate (default %(default)s)")
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--random-range-ratio", type=float, default=0.0,
                    help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: fixed)")
    ap.add_argument("--prefix-repetition-prefix-len", type=int, default=512)
    ap.add_argument("--prefix-repetition-suffix-len", type=int, default=128)
    ap.add_argument("--prefix-repetition-num-prefixes", type=int, default=8)
    ap.add_argument("--prefix-repetition-output-len", type=int, default=64)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake-format trace (JSON lines)")
    ap.add_argument("--trace-length-scale", type=float, default=1.0,
                    help="multiply the trace's lengths (and block size) by this, for small-context models")
    ap.add_argument("--max-model-len", type=int, help="skip trace requests whose input + output exceed this")
    ap.add_argument("--token-range", type=_token_range, default=TokenRange(), metavar="LO:HI",
                    help="prompt token ids are drawn from [LO, HI) (default 100:10000)")
    ap.add_argument("--request-rate", type=_rates, default=[math.inf], metavar="R[,R...]",
                    help="requests/s (Poisson), 'inf' (all at once) or 'trace' (the trace's timing); "
                         "a comma list runs each (default inf)")
    ap.add_argument("--sweep", type=_fractions, metavar="F[,F...]",
                    help="measure saturation (rate inf) first, then run at these fractions of its request rate "
                         "(e.g. 0.5,0.9); replaces --request-rate")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    ap.add_argument("--max-concurrency", type=int, help="at most this many requests in flight")
    ap.add_argument("--goodput", nargs="+", metavar="NAME:MS", help="per-request SLOs, e.g. ttft:2000 tpot:100")
    ap.add_argument("--warmup", type=int, default=2, help="short requests sent (and not counted) before each run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default %(default)s)")
    ap.add_argument("--max-duration", type=float,
                    help="seconds per rate after which no new request is sent (those not sent are not counted)")
    ap.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (default: ignore_eos)")
    ap.add_argument("--out", help="JSON path (default serve_<dataset>.json in the results folder); the PNG goes beside it")
    ap.add_argument("--plot", nargs="+", metavar="JSON", help="only plot these result files together into --out's PNG")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def make_requests(a: argparse.Namespace, run: int = 0) -> list[BenchRequest]:
    """The dataset of the ``run``-th rate: its own seed, so no run finds an earlier run's prompts in the server's
    prefix cache (a trace keeps its sharing within the run)."""
    seed = a.seed + 1000 * run
    if a.num_prompts < 1:
        raise ValueError(f"--num-prompts {a.num_prompts} must be >= 1")
    if a.dataset == "random":
        return random_requests(a.num_prompts, a.random_input_len, a.random_output_len,
                               range_ratio=a.random_range_ratio, tokens=a.token_range, seed=seed)
    if a.dataset == "prefix-repetition":
        return prefix_repetition_requests(a.num_prompts, a.prefix_repetition_prefix_len,
                                          a.prefix_repetition_suffix_len, a.prefix_repetition_num_prefixes,
                                          a.prefix_repetition_output_len, tokens=a.token_range, seed=seed)
    return trace_requests(a.trace, a.num_prompts, length_scale=a.trace_length_scale, max_len=a.max_model_len,
                          tokens=a.token_range, seed=seed)


class _Progress:
    """A rich progress bar over completed requests (nothing when off)."""

    def __init__(self, enabled: bool, total: int, label: str):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), transient=True)
            self.task = self.bar.add_task(label, total=total)

    def __enter__(self):
        if self.bar:
            self.bar.start()
        return self

    def advance(self) -> None:
        if self.bar:
            self.bar.advance(self.task)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.stop()


async def run_rate(client: httpx.AsyncClient, url: str, model: str, reqs: list[BenchRequest], rate: float, *,
                   max_concurrency: int | None = None, burstiness: float = 1.0, seed: int = 0,
                   max_duration: float | None = None, ignore_eos: bool = True,
                   progress: bool = False) -> tuple[list[RequestResult], float]:
    """Send ``reqs`` at ``rate``; (results of those sent, seconds from the first send to the last answer)."""
    times = arrival_times(reqs, rate, seed=seed, burstiness=burstiness)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    label = f"rate {rate:g}" + (f", <= {max_concurrency} in flight" if max_concurrency else "")
    with _Progress(progress, len(reqs), label) as bar:
        start = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult | None:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if max_duration is not None and time.perf_counter() - start > max_duration:
                bar.advance()
                return None
            if sem is None:
                res = await stream_completion(client, url, model, req, ignore_eos)
            else:
                async with sem:
                    res = await stream_completion(client, url, model, req, ignore_eos)
            res.send_s = at
            bar.advance()
            return res

        done = await asyncio.gather(*(one(r, t) for r, t in zip(reqs, times)))
        duration = time.perf_counter() - start
    return [r for r in done if r is not None], duration


async def _server_info(client: httpx.AsyncClient, base: str, model: str | None) -> tuple[str, dict]:
    info: dict[str, Any] = {}
    try:
        v = await client.get(base + "/version", timeout=10)
        if v.status_code == 200:
            info["version"] = v.json()
    except (httpx.HTTPError, ValueError):
        pass
    if model is None:
        r = await client.get(base + "/v1/models", timeout=30)
        r.raise_for_status()
        models = r.json().get("data") or []
        if not models:
            raise RuntimeError(f"{base}/v1/models lists no model; pass --model")
        model = models[0]["id"]
    info["model"] = model
    return model, info


def _print_run(run: dict, label: str) -> None:
    rate = run["request_rate"]
    lines = [f"==== {label}: rate {rate}, max concurrency {run['max_concurrency']} ====",
             f"completed {run['completed']}  failed {run['failed']}  duration {run['duration_s']:.1f} s"
             + (f"  errors {run['errors']}" if run["errors"] else ""),
             f"request throughput {run['request_throughput']:.3f} req/s   output {run['output_throughput']:.1f} tok/s"
             f"   total {run['total_token_throughput']:.1f} tok/s   cached prompt tokens {run['cached_tokens']}"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = run[key]
        lines.append(f"{name:5s} ms  mean {s['mean']:9.1f}  median {s['median']:9.1f}  p99 {s['p99']:9.1f}")
    if "goodput" in run:
        lines.append(f"goodput {run['goodput']['request_goodput']:.3f} req/s ({run['goodput']['good_requests']} "
                     f"requests met {run['goodput']['slo']})")
    print("\n".join(lines), flush=True)


def slo_rate(runs: list[dict], slo: SLO) -> dict | None:
    """The run of highest finite offered rate whose p99 TTFT / TPOT / E2E meet ``slo`` with no failure (the
    distribution-level goodput: requests/s served within the SLO at p99)."""
    best = None
    for run in runs:
        if not math.isfinite(run["request_rate"]) or run["failed"]:
            continue
        if (slo.ttft_ms is None or run["ttft_ms"]["p99"] <= slo.ttft_ms) \
                and (slo.tpot_ms is None or run["tpot_ms"]["p99"] <= slo.tpot_ms) \
                and (slo.e2el_ms is None or run["e2el_ms"]["p99"] <= slo.e2el_ms):
            if best is None or run["request_rate"] > best["request_rate"]:
                best = run
    if best is None:
        return None
    return {"request_rate": best["request_rate"], "request_throughput": best["request_throughput"],
            "output_throughput": best["output_throughput"]}


async def bench(a: argparse.Namespace) -> dict:
    reqs = make_requests(a)  # checked before any request is sent; the dataset's shape for the report
    slo = SLO.parse(a.goodput)
    base = a.base_url.rstrip("/")
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=min(MAX_CONNECTIONS, a.max_concurrency or len(reqs)) + 4,
                          max_keepalive_connections=64)
    timeout = httpx.Timeout(a.timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model, info = await _server_info(client, base, a.model)
        label = a.label or model
        ignore_eos = not a.no_ignore_eos
        warm = random_requests(a.warmup, 16, 4, tokens=a.token_range, seed=a.seed + 7919) if a.warmup else []
        runs: list[dict] = []

        async def one(rate: float) -> dict:
            for w in warm:
                r = await stream_completion(client, url, model, w, ignore_eos)
                if not r.ok:
                    raise RuntimeError(f"warm-up request failed: {r.error}")
            results, duration = await run_rate(client, url, model, make_requests(a, len(runs)) if runs else reqs, rate, max_concurrency=a.max_concurrency,
                                               burstiness=a.burstiness, seed=a.seed, max_duration=a.max_duration,
                                               ignore_eos=ignore_eos, progress=not a.no_progress)
            run = {"request_rate": rate, "max_concurrency": a.max_concurrency, "num_sent": len(results),
                   **summarize(results, duration, slo)}
            _print_run(run, label)
            runs.append(run)
            return run

        saturation = None
        if a.sweep:
            saturation = await one(math.inf)
            top = saturation["request_throughput"]
            if top <= 0:
                raise RuntimeError("no request completed at saturation; nothing to sweep")
            for f in a.sweep:
                run = await one(top * f)
                run["fraction_of_saturation"] = f
        else:
            for rate in a.request_rate:
                await one(rate)
    dataset = {"name": a.dataset, "num_prompts": len(reqs),
               "mean_input_len": sum(len(r.prompt) for r in reqs) / len(reqs),
               "mean_output_len": sum(r.output_len for r in reqs) / len(reqs)}
    out = {"header": machine_header(), "label": label, "server": info, "base_url": base, "dataset": dataset,
           "args": {k: (v if isinstance(v, (int, float, str, bool, list, type(None))) else str(v))
                    for k, v in vars(a).items()},
           "runs": runs}
    if saturation is not None:
        out["saturation"] = {"request_throughput": saturation["request_throughput"],
                             "output_throughput": saturation["output_throughput"]}
    if slo is not None:
        out["slo_rate"] = slo_rate(runs, slo)
    return out


def _num(x: Any) -> float:
    return float(x) if isinstance(x, str) else x


def plot(results: list[dict], png: Path) -> None:
    """TTFT and TPOT (median and p99) against achieved request throughput, one line pair per result."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for res in results:
        runs = sorted(res["runs"], key=lambda r: r["request_throughput"])
        x = [r["request_throughput"] for r in runs]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            for stat, style in (("median", "-o"), ("p99", "--x")):
                ax.plot(x, [_num(r[key][stat]) for r in runs], style, label=f"{res['label']} {stat}")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set_xlabel("achieved requests/s")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ds = results[0].get("dataset", {})
    fig.suptitle(f"{ds.get('name', '')}: {ds.get('mean_input_len', 0):.0f} in / {ds.get('mean_output_len', 0):.0f} "
                 f"out tokens per request")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    out = Path(a.out or RESULTS_DIR / f"serve_{a.dataset}.json")
    png = out.with_suffix(".png")
    if a.plot:
        plot([json.loads(Path(p).read_text()) for p in a.plot], png)
        print(f"wrote {png}")
        return 0
    res = asyncio.run(bench(a))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(res), indent=1) + "\n")
    try:
        plot([json.loads(out.read_text())], png)
    except ImportError:
        log.warning("matplotlib is not installed (pip install 'kvtide[bench]'): no PNG")
    print(f"wrote {out}" + (f" and {png}" if png.exists() else ""))
    return 0 if all(r["completed"] for r in res["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
