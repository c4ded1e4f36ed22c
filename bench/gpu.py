"""`kvtide bench gpu`: the headline GPU figures of docs/benchmarks.md in one command, on a CUDA machine.

Steps, each a subprocess whose output is teed to ``<out-dir>/<step>.log``:

1. ``real-kv``: the real-model KV capture that the kernel sweep and the engine runs tile their KV from
   (``bench/data/real_kv.safetensors``; the suites read it with ``--real-kv``, they do not capture on the fly).
   Used as it is if present; rebuilt from its carried byte planes (``bench/tools/kv_planes.py join``) if those are
   there; else captured from the bundled models (CPU compute; their packages must be installed).
2. ``tests``: the test files that run on CUDA, with a long per-test timeout (FlashInfer compiles at first use).
3. ``zip-attention`` (and ``zip-attention-v1``, not in the default steps): the decode-attention kernel sweep;
   ``zip-engine``: engine decode tokens/s at each backend's largest batch under one KV budget. Flags as the cited
   rows' runs recorded them.
4. A table of each headline figure: the new value, the committed one from the cited JSON under bench/results/, and
   new / committed; also written to ``<out-dir>/gpu_summary.json``.

``--dry-run`` prints the steps; ``--summary DIR...`` prints the table from a finished run's folder(s) (no CUDA
needed); ``--prepare`` (any machine) captures and splits the real KV for an offline GPU machine and prints what to
carry. ``bench/tools/device_run.sh`` runs this on such a machine.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import report

RESULTS = ROOT / "bench" / "results"
REAL_KV = "bench/data/real_kv.safetensors"
PLANES = (".hdr", ".lo.xz", ".hi.xz")  # kv_planes.py's parts, beside the capture
WHEELS = ("flashinfer-python==0.6.12", "apache-tvm-ffi==0.1.15.post2")  # the versions the cited runs used
STEPS = ("real-kv", "tests", "zip-attention", "zip-attention-v1", "zip-engine")
DEFAULT_STEPS = "real-kv,tests,zip-attention,zip-engine"

# Tests that exercise CUDA (kernels, the fused backend, FlashInfer, CUDA graphs, the executor's CUDA paths, pinned
# tiers). Files mixing in tests of the bundled models are named by node id: the GPU machine may lack the models.
GPU_TESTS = (
    "tests/kernels",
    "tests/cache/test_zip_format.py",
    "tests/cache/test_zip_pages.py",
    "tests/engine/test_zip_fused_backend.py",
    "tests/engine/test_flashinfer_backend.py",
    "tests/engine/test_cuda_graphs.py",
    "tests/engine/test_async_scheduling.py::test_cuda_async_steps_give_the_synchronous_tokens",
    "tests/engine/test_async_scheduling.py::test_cuda_async_steps_in_a_small_cache_finish_every_request",
    "tests/restore/test_cuda_paths.py",
    "tests/restore/test_layer_graphs.py::test_cuda_layer_graphs_restore_the_eager_tokens",
    "tests/store/test_pinned_store.py",
)

# Minutes per step on the benchmark GPU, from the cited runs: the kernel sweeps' recorded wall_s (50-52 s) plus
# start-up and FlashInfer's compile; the largest-batch engine runs spanned 2.7-3.2 minutes of clock samples
# (16-52 and 67: 3.8-4.1); 478 kernel and graph tests ran in 59 s, 159 with whole-step graphs in 129 s.
MINUTES = {"real-kv": 0.1, "real-kv-capture": 2.0, "tests": 2.5, "zip-attention": 1.5, "zip-attention-v1": 1.2,
           "zip-engine": 3.5}
MINUTES_QUICK = {"real-kv": 0.1, "real-kv-capture": 2.0, "tests": 1.0, "zip-attention": 0.7,
                 "zip-attention-v1": 0.6, "zip-engine": 1.5}


@dataclass(frozen=True)
class Step:
    """One subprocess of the run (``argv`` empty: nothing to run, ``what`` says why)."""

    name: str
    what: str
    argv: tuple[str, ...]
    minutes: float
    result: str | None = None  # the JSON it writes under the run folder
    needs_real_kv: bool = False


def real_kv_path(arg: str) -> Path:
    """--real-kv as a path: a relative one is taken from the checkout (the suites run there)."""
    p = Path(arg)
    return p if p.is_absolute() else ROOT / p


def _kvtide(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "kvtide.cli", *args)


def real_kv_step(path: Path, quick: bool = False) -> Step:
    """Use the capture at ``path``, join it from its carried planes, or capture it, whichever applies."""
    minutes = MINUTES_QUICK if quick else MINUTES
    rel = _rel(path)
    if path.is_file():
        return Step("real-kv", f"use {rel} ({path.stat().st_size} bytes)", (), minutes["real-kv"])
    if all(path.with_suffix(s).is_file() for s in PLANES):
        return Step("real-kv", f"rebuild {rel} from its carried planes ({', '.join(PLANES)})",
                    (sys.executable, "bench/tools/kv_planes.py", "join", str(path)), minutes["real-kv"])
    return Step("real-kv", f"capture {rel} from the bundled models (CPU compute)",
                _kvtide("bench", "zip-attention", "--capture", str(path)), minutes["real-kv-capture"])


def tests_step(quick: bool, timeout_s: int) -> Step:
    """The CUDA tests (``quick``: the gpu-marked ones among them), ``timeout_s`` a test where pytest-timeout is in."""
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv += ["--timeout", str(timeout_s)]
        limit = f"{timeout_s} s a test"
    else:
        limit = "no per-test limit: pytest-timeout is not installed"
    if quick:
        argv += ["-m", "gpu"]
    return Step("tests", f"{'the gpu-marked' if quick else 'the CUDA'} tests ({limit})", (*argv, *GPU_TESTS),
                (MINUTES_QUICK if quick else MINUTES)["tests"])


def attention_step(version: int, out_dir: Path, real_kv: Path, quick: bool) -> Step:
    name = "zip-attention" if version == 2 else "zip-attention-v1"
    result = f"zip_attention_v{version}.json"
    args = ["bench", "zip-attention", "--real-kv", str(real_kv), "--version", str(version), "--skip-triton"]
    if quick:
        args += ["--contexts", "2048", "--batches", "32", "--rounds", "2", "--rep", "50", "--tune-rep", "10"]
    else:
        args += ["--clean-flush"]
    return Step(name, f"decode-attention kernel sweep, format v{version}, CUDA kernel against FlashInfer",
                _kvtide(*args, "--out", str(out_dir / result)), (MINUTES_QUICK if quick else MINUTES)[name],
                result, needs_real_kv=True)


def engine_step(out_dir: Path, real_kv: Path, batches: str, quick: bool) -> Step:
    args = ["bench", "zip-engine", "--real-kv", str(real_kv), "--cuda-graphs", "--only", "baseline,zip"]
    if quick:
        args += ["--context", "2048", "--steps", "31", "--batches", "8", "--budget-seqs", "8"]
    else:
        args += ["--batches", batches, "--zip-largest", "67"]
    minutes = (MINUTES_QUICK if quick else MINUTES)["zip-engine"] + (0 if quick or batches == "67" else 1.0)
    return Step("zip-engine", "engine decode tok/s, zip over FlashInfer at each one's largest batch, one KV budget",
                _kvtide(*args, "--out", str(out_dir / "zip_engine.json")), minutes, "zip_engine.json",
                needs_real_kv=True)


def plan(a: argparse.Namespace) -> list[Step]:
    """The steps ``a`` asks for, in run order."""
    want = set(STEPS if a.steps == "all" else a.steps.split(","))
    unknown = want - set(STEPS)
    if unknown:
        raise SystemExit(f"--steps: unknown step(s) {sorted(unknown)} (known: {', '.join(STEPS)}, all)")
    real_kv, out = real_kv_path(a.real_kv), Path(a.out_dir).resolve()
    build = {"real-kv": lambda: real_kv_step(real_kv, a.quick),
             "tests": lambda: tests_step(a.quick, a.test_timeout),
             "zip-attention": lambda: attention_step(2, out, real_kv, a.quick),
             "zip-attention-v1": lambda: attention_step(1, out, real_kv, a.quick),
             "zip-engine": lambda: engine_step(out, real_kv, a.engine_batches, a.quick)}
    return [build[name]() for name in STEPS if name in want]


# --- the summary: new figures against the committed ones ---------------------------------------------------------


def _attention_row(doc: dict, context: int, batch: int) -> dict:
    return next((r for r in doc.get("results", []) if r.get("context") == context and r.get("batch") == batch), {})


def _attention_value(context: int, batch: int) -> Callable[[dict], float | None]:
    def value(doc: dict) -> float | None:
        cz = _attention_row(doc, context, batch).get("cuda_zip", {})
        return cz.get("speedup_vs_flashinfer_rounds_median", cz.get("speedup_vs_flashinfer"))
    return value


def _attention_spread(context: int, batch: int) -> Callable[[dict], tuple[float, float] | None]:
    def spread(doc: dict) -> tuple[float, float] | None:
        rounds = _attention_row(doc, context, batch).get("cuda_zip", {}).get("speedup_vs_flashinfer_rounds")
        return (min(rounds), max(rounds)) if rounds else None
    return spread


def _attention_detail(context: int, batch: int) -> Callable[[dict], str]:
    def detail(doc: dict) -> str:
        r = _attention_row(doc, context, batch)
        fi, cz = r.get("flashinfer_us_rounds_median", r.get("flashinfer_us")), r.get("cuda_zip", {})
        us = cz.get("us_rounds_median", cz.get("us"))
        return f"FlashInfer {fi:.1f} us, zip {us:.1f} us" if fi and us else ""
    return detail


def _attention_key(doc: dict) -> object:
    return (doc.get("shape") or {}).get("format_version")


def _largest(doc: dict) -> dict:
    return (doc.get("ratios_zip_over_baseline") or {}).get("largest_batch") or {}


def _engine_largest(doc: dict) -> float | None:
    return _largest(doc).get("zip_over_baseline_tokens_per_s")


def _engine_equal(batch: int) -> Callable[[dict], float | None]:
    return lambda doc: ((doc.get("ratios_zip_over_baseline") or {}).get("equal_batch") or {}).get(str(batch))


def _engine_tok_s(doc: dict, backend: str, batch: int | None) -> float | None:
    return (doc.get("backends", {}).get(backend, {}).get("runs", {}).get(str(batch), {})).get("tokens_per_s")


def _engine_largest_detail(doc: dict) -> str:
    big = _largest(doc)
    z = _engine_tok_s(doc, "zip", big.get("zip_batch"))
    f = _engine_tok_s(doc, "flashinfer", big.get("baseline_batch"))
    return f"zip {z:.0f} tok/s at {big['zip_batch']}, FlashInfer {f:.0f} at {big['baseline_batch']}" if z and f else ""


def _engine_key(doc: dict) -> object:
    s = doc.get("setup", {})
    return ((doc.get("model") or {}).get("name"), s.get("context"), s.get("timed_decode_steps"),
            s.get("kv_cache_bytes"), s.get("format_version"), s.get("cuda_graphs"))


def _engine_largest_key(doc: dict) -> object:
    big = _largest(doc)
    return _engine_key(doc), big.get("zip_batch"), big.get("baseline_batch")


def _engine_compressible(kind: str) -> Callable[[dict], float | None]:
    key = f"{kind}_compressible_block_fraction"
    return lambda doc: (doc.get("backends", {}).get("zip", {}).get("compression_after_prefill") or {}).get(key)


@dataclass(frozen=True)
class Figure:
    """A headline figure: where this run writes it, the committed JSONs it reproduces, how to read it from one."""

    name: str
    result: str
    cited: tuple[str, ...]
    value: Callable[[dict], float | None]
    key: Callable[[dict], object]  # what must be equal in the new and the cited run for the two to compare
    spread: Callable[[dict], tuple[float, float] | None] = lambda doc: None  # within one cited run (rounds)
    detail: Callable[[dict], str] = lambda doc: ""


SHAPES = ((2048, 32), (2048, 64), (2048, 96), (8192, 32), (8192, 64), (8192, 96))
ENGINE_LARGEST = tuple(f"bench/results/zip_engine_{n}_h200.json" for n in (
    "largest", "nudge", "merge", "profile_merge", "largest2", "final", "confirm1", "confirm2", "confirm3", "trace67"))
ENGINE_EQUAL = ("bench/results/zip_engine_merge_h200.json", "bench/results/zip_engine_final_h200.json")

FIGURES: tuple[Figure, ...] = (
    *(Figure(f"attention v{v}, {c} x {b}: zip / FlashInfer", f"zip_attention_v{v}.json",
             (f"bench/results/zip_attention_cuda_v{v}_stage_h200.json",), _attention_value(c, b), _attention_key,
             _attention_spread(c, b), _attention_detail(c, b))
      for v in (2, 1) for c, b in SHAPES),
    Figure("engine tok/s, each at its largest: zip / FlashInfer", "zip_engine.json", ENGINE_LARGEST,
           _engine_largest, _engine_largest_key, detail=_engine_largest_detail),
    *(Figure(f"engine tok/s, equal batch {b}: zip / FlashInfer", "zip_engine.json", ENGINE_EQUAL,
             _engine_equal(b), _engine_key) for b in (16, 32, 48, 52)),
    *(Figure(f"real KV: {k.upper()} blocks compressible (engine pool)", "zip_engine.json",
             ENGINE_LARGEST[:1], _engine_compressible(k), _engine_key) for k in ("k", "v")),
)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _find(name: str, dirs: list[Path]) -> Path | None:
    """The last of ``dirs`` holding ``name`` (a later folder's run overrides an earlier one's)."""
    hits = [d / name for d in dirs if (d / name).is_file()]
    return hits[-1] if hits else None


def figure_row(fig: Figure, dirs: list[Path], root: Path = ROOT) -> dict | None:
    """The summary row of ``fig`` from the run folders ``dirs``; None where this run did not measure it."""
    path = _find(fig.result, dirs)
    new = _load(path) if path else None
    value = fig.value(new) if new else None
    if value is None:
        return None
    cited = [(c, d) for c in fig.cited if (d := _load(root / c)) is not None and fig.value(d) is not None]
    vals = [fig.value(d) for _, d in cited]
    row = {"figure": fig.name, "new": value, "result": path.name, "cited": [c for c, _ in cited],
           "committed": statistics.median(vals) if vals else None, "committed_spread": None, "ratio": None,
           "detail": fig.detail(new), "compared": False}
    if not vals:
        row["detail"] = "no cited value found"
        return row
    row["committed_spread"] = (min(vals), max(vals)) if len(vals) > 1 else fig.spread(cited[0][1])
    if fig.key(new) == fig.key(cited[0][1]):
        row.update(ratio=value / row["committed"], compared=True)
    else:
        row["detail"] = "setup differs from the cited run (e.g. --quick): not compared"
    return row


def tests_outcome(dirs: list[Path]) -> str | None:
    """pytest's closing line ('478 passed in 59.22s') from the run's tests.log."""
    path = _find("tests.log", dirs)
    if path is None:
        return None
    lines = [ln.strip(" =") for ln in path.read_text(errors="replace").splitlines()
             if re.search(r"\b(?:passed|failed|errors?|deselected|no tests ran)\b.*\bin [\d.]+s", ln)]
    return lines[-1] if lines else "no pytest summary line (cut short?)"


def summary(dirs: list[Path], root: Path = ROOT) -> list[dict]:
    return [r for fig in FIGURES if (r := figure_row(fig, dirs, root)) is not None]


def print_summary(rows: list[dict], dirs: list[Path], steps: list[dict] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 160)
    if steps:
        t = Table(title="steps")
        for col in ("step", "status", "minutes", "estimate", "log"):
            t.add_column(col)
        for s in steps:
            t.add_row(s["step"], s["status"], f"{s['seconds'] / 60:.1f}", f"{s['estimate_minutes']:.1f}",
                      s.get("log") or "")
        console.print(t)
    outcome = tests_outcome(dirs)
    if outcome:
        console.print(f"GPU tests: {outcome}")
    t = Table(title="headline GPU figures: new against committed (docs/benchmarks.md)")
    for col, kw in (("figure", {}), ("new", {"justify": "right"}), ("committed", {"justify": "right"}),
                    ("committed spread", {"justify": "right"}), ("new / committed", {"justify": "right"}),
                    ("detail", {})):
        t.add_column(col, **kw)
    for r in rows:
        spread = r["committed_spread"]
        t.add_row(r["figure"], f"{r['new']:.3f}", f"{r['committed']:.3f}" if r["committed"] is not None else "-",
                  f"{spread[0]:.3f}-{spread[1]:.3f}" if spread else "-",
                  f"{r['ratio']:.3f}" if r["ratio"] is not None else "-", r["detail"])
    console.print(t)
    if not rows:
        console.print(f"no headline results in {', '.join(map(str, dirs))}")


# --- running -----------------------------------------------------------------------------------------------------


def _rel(path: Path | str) -> str:
    p = Path(path)
    try:
        return p.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(p)


def shown(argv: tuple[str, ...]) -> str:
    """A step's command as a person would type it: `python`, paths relative to the checkout."""
    return shlex.join(["python" if a == sys.executable else _rel(a) if a.startswith("/") else a for a in argv])


def default_out_dir() -> Path:
    """bench/results/gpu-<date>/ (git-ignored; a second run the same day gets -2, -3, ...)."""
    base = RESULTS / f"gpu-{datetime.date.today().isoformat()}"
    out, n = base, 1
    while out.exists() and any(out.iterdir()):
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def run_step(step: Step, out_dir: Path) -> dict:
    """Run ``step`` from the checkout, its output to the terminal and to <out-dir>/<step>.log; killed at 4x its
    estimate (10 minutes at least)."""
    log = out_dir / f"{step.name}.log"
    limit = max(600.0, 240.0 * step.minutes)
    t0 = time.monotonic()
    print(f"\n== {step.name}: {step.what}\n   {shown(step.argv)}", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f:
        p = subprocess.Popen(step.argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env)
        killer = threading.Timer(limit, p.kill)
        killer.start()
        try:
            assert p.stdout is not None
            for line in p.stdout:
                sys.stdout.write(line)
                f.write(line)
            rc = p.wait()
        finally:
            killer.cancel()
    seconds = time.monotonic() - t0
    status = "ok" if rc == 0 else (f"killed after {limit / 60:.0f} min" if seconds >= limit else f"failed (rc {rc})")
    return {"step": step.name, "status": status, "rc": rc, "seconds": seconds, "estimate_minutes": step.minutes,
            "command": shown(step.argv), "log": log.name}


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def preflight() -> str | None:
    """Why this machine cannot run the GPU steps, or None."""
    import torch

    if not torch.cuda.is_available():
        return ("kvtide bench gpu needs a CUDA device (this torch sees none: "
                f"{torch.__version__}). --dry-run lists the steps; --summary DIR prints a finished run's table; "
                "--prepare captures the real KV for an offline GPU machine")
    missing = [m for m in ("triton", "flashinfer") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"kvtide bench gpu needs {', '.join(missing)}: pip install 'kvtide[gpu]' "
                f"(the cited runs: {', '.join(WHEELS)}); offline, carry their wheels (docs/benchmarks.md)")
    return None


def prepare(a: argparse.Namespace) -> int:
    """On a machine with the bundled models: capture the real KV (if missing), split it into the planes that
    travel, and print what an offline GPU machine needs carried."""
    path = real_kv_path(a.real_kv)
    if not path.is_file():
        step = real_kv_step(path)
        if subprocess.run(step.argv, cwd=ROOT, check=False).returncode:
            return 1
    if subprocess.run((sys.executable, "bench/tools/kv_planes.py", "split", str(path)), cwd=ROOT,
                      check=False).returncode:
        return 1
    carry = [".whl", *(_rel(path.with_suffix(s)) for s in PLANES)]
    print(f"real KV: {_rel(path)} sha1 {_sha1(path)} (join prints the same on the GPU machine)")
    if not any((ROOT / ".whl").glob("flashinfer_python-*.whl")):
        print("wheels: none in .whl/; fetch them with\n  python3 -m pip download --no-deps --only-binary=:all: "
              "--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform "
              "manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "
              + " ".join(WHEELS))
    print(f"carry: {json.dumps(carry)}\ncommand: bash bench/tools/device_run.sh")
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=None,
                    help="where the results and logs go (default bench/results/gpu-<date>/, git-ignored)")
    ap.add_argument("--steps", default=DEFAULT_STEPS,
                    help=f"comma list of {', '.join(STEPS)}, or all (default: {DEFAULT_STEPS})")
    ap.add_argument("--real-kv", default=REAL_KV,
                    help="the real-KV capture the suites tile their KV from (a relative path: from the checkout)")
    ap.add_argument("--engine-batches", default="67",
                    help="zip-engine --batches (67: each backend's largest only; 16,32,48,52 adds the equal-batch "
                         "figures, ~1 minute more)")
    ap.add_argument("--test-timeout", type=int, default=600, help="seconds a test may take (pytest-timeout)")
    ap.add_argument("--quick", action="store_true",
                    help="a short smoke run: gpu-marked tests, one attention shape, a small engine run "
                         "(its engine figures do not compare with the committed ones)")
    ap.add_argument("--dry-run", action="store_true", help="print the steps and their estimates; run nothing")
    ap.add_argument("--summary", type=Path, nargs="+", metavar="DIR",
                    help="print the table of finished run folders (later ones override earlier); run nothing")
    ap.add_argument("--prepare", action="store_true",
                    help="capture and split the real KV for an offline GPU machine; print what to carry")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.summary:
        print_summary(summary(a.summary), a.summary)
        return 0
    if a.prepare:
        return prepare(a)
    if a.out_dir is None:
        a.out_dir = default_out_dir()
    steps = plan(a)
    if a.dry_run:
        print(f"kvtide bench gpu{' --quick' if a.quick else ''}: {len(steps)} steps, about "
              f"{sum(s.minutes for s in steps):.1f} minutes of GPU time; results in {_rel(a.out_dir)}/")
        for i, s in enumerate(steps, 1):
            print(f"{i}. {s.name} (~{s.minutes:.1f} min): {s.what}")
            print(f"   {shown(s.argv) if s.argv else '(nothing to run)'}")
        print(f"{len(steps) + 1}. summary: new figures against the committed ones -> "
              f"{_rel(a.out_dir)}/gpu_summary.json")
        return 0
    why = preflight()
    if why:
        print(f"kvtide: error: {why}", file=sys.stderr)
        return 2
    out = Path(a.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    done: list[dict] = []
    real_kv_ok = True
    for step in steps:
        if step.needs_real_kv and not (real_kv_ok and real_kv_path(a.real_kv).is_file()):
            done.append({"step": step.name, "status": "skipped: no real-KV capture", "rc": None, "seconds": 0.0,
                         "estimate_minutes": step.minutes, "command": shown(step.argv), "log": None})
            continue
        if not step.argv:
            print(f"\n== {step.name}: {step.what}", flush=True)
            done.append({"step": step.name, "status": "ok", "rc": 0, "seconds": 0.0, "estimate_minutes": step.minutes,
                         "command": "", "log": None})
            continue
        done.append(run_step(step, out))
        if step.name == "real-kv":
            real_kv_ok = done[-1]["rc"] == 0
    rows = summary([out])
    kv = real_kv_path(a.real_kv)
    report.write(out / "gpu_summary.json", {
        "suite": "gpu", "quick": a.quick, "real_kv": {"path": a.real_kv, "sha1": _sha1(kv) if kv.is_file() else None},
        "steps": done, "tests": tests_outcome([out]), "figures": rows}, argv=argv, png=False)
    print()
    print_summary(rows, [out], done)
    return 0 if all(s["rc"] == 0 for s in done if s["rc"] is not None) and all(
        not s["status"].startswith("skipped") for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
