"""GPU: what the engine's decode-step CUDA graphs hold (node types, dependencies, kernels with grid and shared memory,
read through the driver API) and the idle between their kernels when replayed alone, with no engine host work around
them; then where the idle comes from.

Why: in the engine's H200 profile (bench/results/trace_gaps_*67*), the zip whole-step graph idles ~0.4 us before
each small kernel, FlashInfer's piecewise graphs ~0.1 us, same model kernels; bench/tools/graph_chain.py's synthetic
chains show ~0.26 us at every graph size.

    python bench/tools/graph_nodes.py --out $OUT/graph_nodes_h200.json [--layers 8] [--cases zip:whole,flashinfer:piecewise]
    python bench/tools/graph_nodes.py --interplay --out ...   # FlashInfer's graphs and a probe chain beside a zip engine
    python bench/tools/graph_nodes.py --bisect --out ...      # which step of a zip engine's life slows the probe chain
    python bench/tools/graph_nodes.py --simple-ops --out ...  # whether plain stream operations move it back
    python bench/tools/graph_nodes.py --sequence zip-merge,fi-attn,zip-gen-1,fi-attn --out ...  # actions, probe after each
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.tools.trace_gaps import family  # noqa: E402
from kvtide.config import CacheConfig, SchedulerConfig  # noqa: E402
from kvtide.engine.llm import LLM  # noqa: E402
from kvtide.engine.sampling_params import SamplingParams  # noqa: E402

PAGE = 16
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}


def keep_graphs() -> None:
    """Every CUDA graph keeps its cudaGraph_t (keep_graph=True: instantiated on first replay), for inspection."""
    cls = torch.cuda.CUDAGraph
    new, init = cls.__new__, cls.__init__  # the C++ object takes keep_graph in __init__ (pybind), torch's in __new__

    def __new__(c, keep_graph: bool = True):
        return new(c, True)

    def __init__(self, keep_graph: bool = True):
        init(self, True)

    cls.__new__, cls.__init__ = __new__, __init__


def graph_nodes(g: torch.cuda.CUDAGraph) -> dict:
    """Node types, dependencies (a chain has one root and at most one dependency per node) and, per kernel node,
    name, grid, block and shared memory, read through the driver API from the graph's cudaGraph_t."""
    import ctypes

    from kvtide.kernels.cuda_jit import driver

    lib = driver()
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    graph = vp(g.raw_cuda_graph())
    n = sz()
    assert lib.cuGraphGetNodes(graph, None, ctypes.byref(n)) == 0
    nodes = (vp * n.value)()
    assert lib.cuGraphGetNodes(graph, nodes, ctypes.byref(n)) == 0
    roots = sz()
    assert lib.cuGraphGetRootNodes(graph, None, ctypes.byref(roots)) == 0
    deps_fn = getattr(lib, "cuGraphNodeGetDependencies_v2", None)  # (node, deps, edge data, count): CUDA >= 12.3
    types: Counter = Counter()
    multi_dep = 0
    kernels = []
    for node in nodes:
        t = ctypes.c_int()
        lib.cuGraphNodeGetType(vp(node), ctypes.byref(t))
        types[NODE_TYPES.get(t.value, str(t.value))] += 1
        d = sz()
        if deps_fn is not None:
            deps_fn(vp(node), None, None, ctypes.byref(d))
        else:
            lib.cuGraphNodeGetDependencies(vp(node), None, ctypes.byref(d))
        multi_dep += d.value > 1
        if t.value == 0:
            kernels.append(_kernel_node(lib, vp(node)))
    return {"nodes": n.value, "types": dict(types), "roots": roots.value, "nodes_with_several_deps": multi_dep,
            "kernels_listed": len(kernels), "first_kernels": kernels[:90],
            "kernel_names": dict(Counter(k["name"][:50] for k in kernels).most_common(40))}


def _kernel_node(lib, node) -> dict:
    """Name, grid, block and shared memory of one kernel node (CUDA_KERNEL_NODE_PARAMS_v2: func, grid x3, block
    x3, dynamic shared bytes, kernelParams, extra, kern, ctx; a runtime launch may hold a CUkernel, not a func)."""
    import ctypes

    buf = (ctypes.c_char * 256)()
    get = getattr(lib, "cuGraphKernelNodeGetParams_v2", None) or lib.cuGraphKernelNodeGetParams
    if get(node, buf) != 0:
        return {"name": "?"}
    func, kern = ctypes.c_void_p.from_buffer(buf, 0), ctypes.c_void_p.from_buffer(buf, 56)
    dims = (ctypes.c_uint * 7).from_buffer(buf, 8)
    name, static = ctypes.c_char_p(), ctypes.c_int(-1)
    if func.value:
        lib.cuFuncGetName(ctypes.byref(name), func)
        lib.cuFuncGetAttribute(ctypes.byref(static), 1, func)  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
    elif kern.value and hasattr(lib, "cuKernelGetName"):
        lib.cuKernelGetName(ctypes.byref(name), kern)
    return {"name": (name.value or b"?").decode(errors="replace")[:80], "grid": list(dims[:3]),
            "block": list(dims[3:6]), "dyn_smem": dims[6], "static_smem": static.value}


def replay_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def idle_between_kernels(fn, reps: int = 3) -> dict:
    """Idle between consecutive device ops of ``reps`` back-to-back calls of ``fn`` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    ops = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    gaps = [(b.time_range.start - a.time_range.end, family(b.name)) for a, b in zip(ops, ops[1:])]
    small = [g for g, _ in gaps if g < 20]
    by_fam: dict[str, list[float]] = {}
    for g, f in gaps:
        if g < 20:
            by_fam.setdefault(f, []).append(g)
    dur: dict[str, list[float]] = {}
    for e in ops:
        dur.setdefault(family(e.name), []).append(e.time_range.end - e.time_range.start)
    return {"ops_per_call": len(ops) / reps,
            "op_us_median_by_family": {f: round(statistics.median(v), 3) for f, v in sorted(dur.items())}, "small_gap_us_median": statistics.median(small) if small else None,
            "small_gap_ms_per_call": sum(small) / reps / 1e3,
            "small_gap_us_median_by_next_family": {f: round(statistics.median(v), 3) for f, v in sorted(by_fam.items())},
            "device_ms_per_call": sum(e.time_range.end - e.time_range.start for e in ops) / reps / 1e3}


def model_name(layers: int) -> str:
    """The random-weight 8B preset, with ``layers`` layers (registered as a preset of its own when not 32)."""
    if layers == 32:
        return "random:llama3-8b"
    import dataclasses

    from kvtide.models.loader import RANDOM_PRESETS
    RANDOM_PRESETS[f"llama3-8b-L{layers}"] = lambda: dataclasses.replace(RANDOM_PRESETS["llama3-8b"](),
                                                                       num_layers=layers)
    return f"random:llama3-8b-L{layers}"


def make_llm(backend: str, a, full_cuda_graphs: bool | None, batches: int = 1, cuda_graphs: bool = True) -> LLM:
    """An engine of ``backend`` at the 8B shape with ``a.layers`` layers, CUDA graphs on (``full_cuda_graphs``: whole
    steps, piecewise, None for the backend's default; ``cuda_graphs=False``: none) and KV room for ``batches`` x
    ``a.batch`` sequences."""
    budget_pages = batches * a.batch * (-(-(a.context + 16) // PAGE) + 2) + 64
    return LLM(model_name(a.layers), progress=False, device="cuda", dtype="bfloat16", attention_backend=backend,
               seed=0, cuda_graphs=cuda_graphs, full_cuda_graphs=full_cuda_graphs if cuda_graphs else None,
               cache=CacheConfig(kv_cache_bytes=budget_pages * a.layers * 2 * PAGE * 8 * 128 * 2,
                                 compress=backend == "zip"),
               scheduler=SchedulerConfig(max_num_seqs=4096, max_num_batched_tokens=16384,
                                         max_model_len=a.context + 64))


def generate(llm: LLM, a, max_tokens: int, salt: int = 0) -> None:
    """``a.batch`` prompts of ``a.context`` tokens (``salt``: other prompts, no prefix-cache hits), then a sync."""
    vocab = llm.engine.model.args.vocab_size
    llm.generate([[(7 * i + 13 * j + 101 * salt) % vocab for j in range(a.context)] for i in range(a.batch)],
                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    torch.cuda.synchronize()


class Nvml:
    """SM clock (MHz), power (W) and the clock event reasons (NVML bit mask: 0x4 SW power cap, 0x8 HW slowdown,
    0x20 SW thermal, ...) through libnvidia-ml, for telling a clock state from a launch-path state; empty
    readings where the library is missing."""

    def __init__(self) -> None:
        import ctypes

        self.ct, self.lib, self.h = ctypes, None, ctypes.c_void_p()
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() == 0 and lib.nvmlDeviceGetHandleByIndex_v2(torch.cuda.current_device(),
                                                                              ctypes.byref(self.h)) == 0:
                self.lib = lib
        except OSError:
            pass

    def read(self) -> dict:
        if self.lib is None:
            return {}
        ct = self.ct
        clk, mw, reasons = ct.c_uint(), ct.c_uint(), ct.c_ulonglong()
        self.lib.nvmlDeviceGetClockInfo(self.h, 1, ct.byref(clk))  # NVML_CLOCK_SM
        self.lib.nvmlDeviceGetPowerUsage(self.h, ct.byref(mw))
        self.lib.nvmlDeviceGetCurrentClocksThrottleReasons(self.h, ct.byref(reasons))
        return {"sm_mhz": clk.value, "power_w": mw.value / 1e3, "reasons": hex(reasons.value)}


class ProbeLog:
    """The probe chain's replay time (best of 3 medians) after each labelled action, as rows for the JSON, with the
    SM clock read right after the action and after the probe."""

    def __init__(self, a, width: int):
        self.probe, self._keep = probe_chain()
        self.iters, self.width = a.iters, width
        self.rows: list[dict] = []
        self.nvml = Nvml()

    def __call__(self, label: str, error: str | None = None) -> None:
        before = self.nvml.read()
        ms = [replay_ms(self.probe, self.iters) for _ in range(3)]
        after = self.nvml.read()
        self.rows.append({"after": label, "probe_ms": ms, "nvml_before": before, "nvml_after": after,
                          **({"error": error} if error else {})})
        clocks = f"  SM {before.get('sm_mhz')}/{after.get('sm_mhz')} MHz {before.get('reasons')}" if before else ""
        print(f"{label:<{self.width}} probe {min(ms):.4f} ms / 200 kernels{clocks}"
              f"{'  ERROR ' + error if error else ''}", flush=True)


def engine_graphs(backend: str, whole: bool, a):
    """An engine of ``backend`` after a short generate, and a function replaying its decode-step graph(s) of
    ``a.batch`` sequences back to back (piecewise: the segments without the attention between them, whose buffers
    keep their values). Returns (llm, replay function, graphs); (llm, None, error) when nothing was captured."""
    llm = make_llm(backend, a, whole)
    generate(llm, a, 6)
    g = llm.engine.runner.graphs
    if whole:
        if not g.full:
            return llm, None, "no whole-step graph captured"
        graphs = [list(g.full.values())[-1].graph]
    else:
        if g.cache.get(a.batch) is None:
            return llm, None, f"no piecewise graph of batch {a.batch} captured"
        graphs = g.cache[a.batch].graphs

    def fn():
        for gr in graphs:
            gr.replay()
    return llm, fn, graphs


def one(backend: str, whole: bool, a) -> dict:
    llm, fn, graphs = engine_graphs(backend, whole, a)
    out: dict = {"backend": backend, "whole_step": whole, "batch": a.batch, "context": a.context}
    if fn is None:
        out["error"] = graphs
        return out
    out["graphs_per_step"] = len(graphs)
    out["replay_ms_median"] = replay_ms(fn, a.iters)  # replays first: a kept graph is instantiated by its first
    try:
        out["graph"] = [graph_nodes(gr) for gr in graphs[:2]]
    except Exception as e:  # the inspection is best effort (driver entry points vary by CUDA version)
        out["graph"] = f"{type(e).__name__}: {e}"
    out["profile"] = idle_between_kernels(fn)
    print(f"{backend:>10} {'whole' if whole else 'piecewise':>9}: {out['replay_ms_median']:.3f} ms/replay, "
          f"{out['profile']['ops_per_call']:.0f} ops, small gaps median {out['profile']['small_gap_us_median']} us, "
          f"{out['profile']['small_gap_ms_per_call']:.3f} ms/call; graph {str(out['graph'])[:300]}", flush=True)
    del llm, fn, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def capture(fn) -> torch.cuda.CUDAGraph:
    """``fn``'s launches captured in a CUDA graph on a side stream (warm-up is the caller's), then a sync."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        g.capture_begin()
        fn()
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    return g


def probe_chain(n: int = 200):
    """A captured chain of ``n`` tiny dependent kernels, owned by no engine: the state of the process, not of a graph."""
    x = torch.zeros(67, 4096, dtype=torch.bfloat16, device="cuda")
    x.add_(1.0)

    def chain() -> None:
        for _ in range(n):
            x.add_(1.0)
    g = capture(chain)
    return g.replay, (g, x)


def interplay(a) -> list[dict]:
    """One process: FlashInfer's piecewise graphs and a probe chain timed alone, beside a zip engine, and after it
    is gone. Tells a state of the process (every graph slow while a zip engine lives) from one of the graphs."""
    rows = []
    probe, _keep = probe_chain()

    def measure(label: str, fns: dict) -> None:
        row = {"when": label}
        for k, f in fns.items():
            row[k] = {"replay_ms_median": replay_ms(f, a.iters),
                      "small_gap_us_median": idle_between_kernels(f)["small_gap_us_median"]}
        rows.append(row)
        print(label, {k: (round(v["replay_ms_median"], 4), v["small_gap_us_median"]) for k, v in row.items()
                      if k != "when"}, flush=True)

    measure("no engine", {"probe": probe})
    fi, fi_fn, _ = engine_graphs("flashinfer", False, a)
    measure("flashinfer piecewise engine", {"probe": probe, "flashinfer": fi_fn})
    z, z_fn, _ = engine_graphs("zip", False, a)
    measure("flashinfer and zip piecewise engines", {"probe": probe, "flashinfer": fi_fn, "zip": z_fn})
    del z, z_fn
    gc.collect()
    torch.cuda.empty_cache()
    measure("flashinfer engine, zip engine deleted", {"probe": probe, "flashinfer": fi_fn})
    z, z_fn, _ = engine_graphs("zip", False, a)
    measure("zip engine built again", {"probe": probe, "flashinfer": fi_fn, "zip": z_fn})
    return rows


def bisect(a) -> list[dict]:
    """Which step of a zip engine's life slows a probe chain of tiny kernels (no profiler anywhere: CUPTI is not a
    suspect): the CUDA kernel's cubins loaded, one zip_decode launch, the engine built, its generate; then whether a
    FlashInfer engine's construction or generate brings the chain back."""
    from kvtide.kernels import zip_attention_cuda as zc

    measure = ProbeLog(a, 44)
    measure("nothing")
    zc.build(torch.device("cuda"), 128, 2)
    measure("zip cubins built and loaded")
    from bench.tools.graph_chain import make_extra

    launch = make_extra("zip", torch.device("cuda"))
    launch()
    torch.cuda.synchronize()
    measure("one zip_decode launch")
    keep = []
    for backend in ("zip", "flashinfer", "zip", "flashinfer"):
        llm = make_llm(backend, a, False)
        measure(f"{backend} engine built")
        generate(llm, a, 6)
        measure(f"{backend} engine generated")
        keep.append(llm)
    return measure.rows


def simple_ops(a) -> list[dict]:
    """Plain stream operations, each followed by the probe chain: whether one of them moves the process between the
    fast and the slow state (bench/tools/graph_nodes.py bisect), first from the fast state, then after a zip engine's
    generate has slowed it, then after a FlashInfer engine's generate."""
    measure = ProbeLog(a, 48)
    dev = torch.device("cuda")
    x = torch.randn(1 << 20, device=dev)
    y = torch.empty_like(x)
    host = torch.empty(1 << 20, pin_memory=True)

    def d2h_event():
        host.copy_(x, non_blocking=True)
        e = torch.cuda.Event()
        e.record()
        e.synchronize()

    ops = {"memset (zero_)": lambda: x.zero_(), "device copy (copy_)": lambda: y.copy_(x),
           "pinned host to device": lambda: x.copy_(host, non_blocking=True),
           "pinned device to host, event": d2h_event,
           "torch.randn (Philox)": lambda: torch.randn(1 << 16, device=dev),
           "synchronize": torch.cuda.synchronize}

    def all_ops(tag: str) -> None:
        for name, op in ops.items():
            op()
            torch.cuda.synchronize()
            measure(f"{tag}: {name}")

    measure("nothing")
    all_ops("fresh")
    keep = []
    for backend in ("zip", "flashinfer"):
        llm = make_llm(backend, a, False)
        generate(llm, a, 6)
        measure(f"{backend} engine generated")
        all_ops(f"after {backend}")
        keep.append(llm)
    return measure.rows


def zip_kernel_action(kind: str, stage: int | None = None):
    """One launch of the CUDA zip kernel over 8 sequences of 64 pages (synthetic v2 pool), in the launch form
    ``kind`` names: 'merge' (4 even splits, global zip_merge), 'cta' (4 splits merged in the CTA), 'balanced'
    (balanced runs, zip_merge_balanced)."""
    from bench.zip_attention import D, HKV, HQ, PS, cuda_inputs, synth_kv
    from kvtide.kernels import zip_attention_cuda as zc

    dev = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool, gstart, gdesc = cuda_inputs(synth_kv(64, 0.1, 0.0, gen), 2)["cuda_zip"]
    b = 8
    indptr = torch.arange(b + 1, dtype=torch.int32) * 64
    kw = {"merge": dict(num_splits=4, cta_merge=False, balanced=False),
          "cta": dict(num_splits=4, cta_merge=True, balanced=False),
          "balanced": dict(balanced=True, cta_merge=False)}[kind]
    p = zc.plan(indptr, (torch.arange(b * 64, dtype=torch.int32) % 64).to(dev), torch.full((b,), PS, dtype=torch.int32),
                HQ, HKV, D, PS, version=2, device=dev, options=zc.LaunchOptions(stage=stage, **kw))
    q = torch.randn(b, HQ, D, device=dev).bfloat16()
    out = torch.empty_like(q)
    return lambda: zc.run(p, q, pool, gstart, gdesc, out=out)


def zip_graph_action(kind: str, stage: int | None = None):
    """:func:`zip_kernel_action`'s launch captured in a CUDA graph (built and captured now), replayed by the
    returned function: whether the slow state needs the zip kernel inside a graph. The function keeps the launch's
    tensors alive (the first H200 run returned only ``g.replay``: the plan's buffers went back to the allocator, a
    later engine took them, and a replay after it hit an illegal memory access)."""
    launch = zip_kernel_action(kind, stage)
    launch()
    g = capture(launch)

    def replay() -> None:  # holds ``launch``: its closure owns the tensors the graph reads and writes
        g.replay()
    replay.keep = launch
    return replay


SYN_SOURCE = r"""
extern "C" __global__ void syn(float* x, int n) {
    extern __shared__ float s[];
    if (n > 0) { s[threadIdx.x] = x[threadIdx.x]; __syncthreads(); x[blockIdx.x] += s[(threadIdx.x + 1) % blockDim.x]; }
    else if (threadIdx.x == 0) { x[blockIdx.x] += 1.0f; }
}
"""


class SynKernel:
    """A trivial kernel launched through the driver API with chosen dynamic shared memory, grid, carveout
    preference and programmatic-dependent-launch attribute: which launch property sets or clears the slow state.
    Action ``syn-<KB>-<grid>[-c<carveout %>][-pdl|-pdl0][-cl1]`` (pdl0: the attribute set to 0; cl1: a 1-CTA
    cluster attribute; either goes through cuLaunchKernelEx)."""

    def __init__(self) -> None:
        import ctypes

        from kvtide.kernels import cuda_jit

        self.ct, self.jit = ctypes, cuda_jit
        dev = torch.cuda.current_device()
        cc = torch.cuda.get_device_capability()
        cubin, _ = cuda_jit.compile_cubin(SYN_SOURCE, "syn", cc[0] * 10 + cc[1])
        self.k = cuda_jit.load(cubin, ["syn"], dev)["syn"]
        self.x = torch.zeros(1 << 16, device="cuda")

    def __call__(self, parts: list[str]) -> None:
        ct, drv = self.ct, self.jit.driver()
        kb, grid = int(parts[1]), int(parts[2])
        carve = next((int(p[1:]) for p in parts[3:] if p[:1] == "c" and p[1:].isdigit()), None)
        pdl = 1 if "pdl" in parts[3:] else 0 if "pdl0" in parts[3:] else None
        cluster = "cl1" in parts[3:]
        smem = kb * 1024
        self.jit._check(drv.cuFuncSetAttribute(self.k.func, 8, max(smem, 0)), "max dynamic smem")
        self.jit._check(drv.cuFuncSetAttribute(self.k.func, 9, -1 if carve is None else carve), "carveout")
        args = [ct.c_void_p(self.x.data_ptr()), ct.c_int(1 if smem else 0)]
        params = (ct.c_void_p * 2)(*[ct.cast(ct.byref(c), ct.c_void_p) for c in args])
        stream = ct.c_void_p(torch.cuda.current_stream().cuda_stream)
        if pdl is None and not cluster:
            self.jit._check(drv.cuLaunchKernel(self.k.func, grid, 1, 1, 128, 1, 1, smem, stream, params, None),
                            "cuLaunchKernel(syn)")
            return

        attrs = (self.jit._LaunchAttr * 2)()
        n = 0
        if pdl is not None:
            attrs[n].id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attrs[n].value = pdl.to_bytes(4, "little")
            n += 1
        if cluster:
            attrs[n].id = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, 1 x 1 x 1
            attrs[n].value = b"".join((1).to_bytes(4, "little") for _ in range(3))
            n += 1
        cfg = self.jit._LaunchConfig((ct.c_uint * 3)(grid, 1, 1), (ct.c_uint * 3)(128, 1, 1), smem, stream, attrs, n)
        self.jit._check(drv.cuLaunchKernelEx(ct.byref(cfg), self.k.func, params, None), "cuLaunchKernelEx(syn)")


class FlashInferActions:
    """One decode step of the FlashInfer backend alone, 67 sequences of 64 pages in a small cache of its own, built
    (and planned once) up front, then in parts: 'attn' (plan, the Triton paged write, FlashInfer's decode kernel),
    'plan', 'write' (the Triton paged write alone), 'kernel' (FlashInfer's decode kernel alone, on the last plan)."""

    def __init__(self) -> None:
        from kvtide.engine.attention import BatchLayout
        from kvtide.engine.attention.flashinfer_attn import FlashInferAttention
        from kvtide.kernels.kv_write import write_paged

        dev = torch.device("cuda")
        b, pages = 67, 64
        self.cache = torch.randn(b * pages, 2, PAGE, 8, 128, device=dev).bfloat16()
        self.fi = FlashInferAttention([self.cache], 32, 8, 128, PAGE)
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
        self.slots = torch.tensor([t[-1] * PAGE + PAGE - 1 for t in tables], dtype=torch.long, device=dev)
        self.layout = BatchLayout([1] * b, [pages * PAGE] * b, tables, self.slots, PAGE)
        self.q, self.k, self.v = (torch.randn(b, h, 128, device=dev).bfloat16() for h in (32, 8, 8))
        self.fi.plan(self.layout)
        self._write = write_paged
        torch.cuda.synchronize()

    def attn(self) -> None:
        self.fi.plan(self.layout)
        self.fi(0, self.q, self.k, self.v)

    def plan(self) -> None:
        self.fi.plan(self.layout)

    def write(self) -> None:
        self._write(self.cache, self.k, self.v, self.slots)

    def kernel(self) -> None:
        self.fi.wrapper.run(self.q, self.cache)


class StoreActions:
    """The compressed store's own GPU work at the 8B shape (2 layers, 8 KV heads, head_dim 128, format v2, the CUDA
    kernel's value order), one action at a time: the fused write of 64 pages' tokens, their compression (GPU
    encoder and placement), reading them back (decompress, as prefill chunks do)."""

    def __init__(self) -> None:
        from kvtide.cache.zip_pages import ZipGeometry, ZipPagedKV
        from kvtide.engine.pool_kernels import triton_pool_kernels

        self.geo = ZipGeometry(2, 8, 128, PAGE, format_version=2, value_order="mma")
        self.store = ZipPagedKV(self.geo, 256 * self.geo.raw_page_bytes, device="cuda", kernels=triton_pool_kernels())
        self.pids = list(range(64))
        self.store.alloc_pages(self.pids)
        self.slots = torch.tensor([p * PAGE + o for p in self.pids for o in range(PAGE)], device="cuda")

    def write(self) -> None:
        gen = torch.Generator(device="cuda").manual_seed(0)
        for layer in range(self.geo.num_layers):
            k, v = (torch.randn(len(self.slots), 8, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
            self.store.write(layer, k, v, self.slots)

    def compress(self) -> None:
        self.store.compress(self.pids)

    def read(self) -> None:
        self.store.read_pages(0, torch.tensor(self.pids, device="cuda"))


def sequence(a) -> list[dict]:
    """Actions in the given order, each followed by the probe chain: which one sets the slow state, which clears it.
    Engines (8B-shaped, built once per kind, each generate on fresh prompts): zip-gen-N / fi-gen-N (that backend's
    default CUDA graphs; N=1 is prefill and compression only), zip-piece-gen-N / fi-whole-gen-N / zip-eager-gen-N
    (piecewise graphs / whole-step graphs / none). Single launches: zip-merge / zip-cta / zip-balanced (one
    zip_decode launch in that form; -s0 at the end: stage 0, no shared-memory staging), zip-graph-merge / -cta /
    -balanced (that launch captured in a CUDA graph, replayed 3 times), fi-attn / fi-plan / fi-write / fi-kernel
    (:class:`FlashInferActions`), syn-KB-GRID[-cPCT][-pdl|-pdl0][-cl1] (:class:`SynKernel`), mm (a cuBLAS GEMM of
    the 8B's shape). Store: store-write / store-compress / store-read (:class:`StoreActions`, in that order: a store's
    pages are written once and compressed once). Others: sleep-S (S seconds idle), g:A+B+... (those actions captured
    in one CUDA graph, replayed 3 times; the probe also runs right after the capture, whose eager warm-up runs the
    actions once)."""
    import time

    measure = ProbeLog(a, 24)
    engines: dict[str, LLM] = {}
    store: list[StoreActions] = []
    acts = a.sequence.split(",")
    fi = FlashInferActions() if any("fi-" in x and "-gen-" not in x for x in acts) else None
    graphs: dict[str, object] = {}
    syn: list[SynKernel] = []
    round_ = [0]

    def run_engine(backend: str, mode: str, n: int) -> None:
        key = f"{backend}:{mode}"
        if key not in engines:
            whole = {"default": None, "piece": False, "whole": True, "eager": None}[mode]
            engines[key] = make_llm(backend, a, whole, batches=2, cuda_graphs=mode != "eager")
        round_[0] += 1
        generate(engines[key], a, n, salt=round_[0])

    def do(act: str) -> None:
        parts = act.split("-")
        if act.startswith("g:"):  # these actions ('+'-separated) captured in one CUDA graph, replayed 3 times
            if act not in graphs:
                subs = act[2:].split("+")
                for sub in subs:
                    do(sub)
                torch.cuda.synchronize()
                graphs[act] = capture(lambda: [do(sub) for sub in subs]).replay
                measure(f"({act}: captured)")
            for _ in range(3):
                graphs[act]()
        elif "gen" in parts:
            backend = {"zip": "zip", "fi": "flashinfer"}[parts[0]]
            mode = parts[1] if len(parts) == 4 else "default"
            run_engine(backend, mode, int(parts[-1]))
        elif act.startswith("zip-graph-"):
            if act not in graphs:
                graphs[act] = zip_graph_action(parts[2], 0 if parts[-1] == "s0" else None)
            for _ in range(3):
                graphs[act]()
        elif act.startswith("zip-"):
            zip_kernel_action(parts[1], 0 if parts[-1] == "s0" else None)()
        elif act.startswith("fi-"):
            getattr(fi, parts[1])()
        elif act in ("store-write", "store-compress", "store-read"):
            if not store:
                store.append(StoreActions())
            getattr(store[0], parts[1])()
        elif act.startswith("syn-"):
            if not syn:
                syn.append(SynKernel())
            syn[0](parts)
        elif act == "mm":
            w = torch.randn(4096, 4096, device="cuda").bfloat16()
            torch.randn(67, 4096, device="cuda").bfloat16() @ w
        elif act.startswith("sleep-"):
            time.sleep(float(parts[1]))
        else:
            raise ValueError(f"unknown action {act}")

    measure("nothing")
    for act in acts:
        err = None
        try:
            do(act)
            torch.cuda.synchronize()
        except Exception as e:  # record and go on: the other actions still tell something
            err = f"{type(e).__name__}: {e}"[:300]
        measure(act, err)
    return measure.rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=67)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--interplay", action="store_true", help="instead of --cases: bench/tools/graph_nodes.py interplay()")
    ap.add_argument("--bisect", action="store_true", help="instead of --cases: bench/tools/graph_nodes.py bisect()")
    ap.add_argument("--simple-ops", action="store_true", help="instead of --cases: bench/tools/graph_nodes.py simple_ops()")
    ap.add_argument("--sequence", default=None,
                    help="instead of --cases: these actions in order, the probe after each (bench/tools/graph_nodes.py "
                         "sequence()), e.g. zip-merge,zip-cta,zip-balanced,fi-attn,zip-gen-1,fi-attn,zip-gen-6,fi-attn")
    ap.add_argument("--cases", default="zip:piecewise,flashinfer:piecewise,zip:whole,flashinfer:whole")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/tools/graph_nodes.py needs a CUDA device")
    keep_graphs()
    res = {"suite": "graph_nodes", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "model": "random weights at the Llama-3.1-8B shape",
           "layers": a.layers, "note": "graphs replayed alone after a short generate (prompts of --context tokens)",
           "results": []}
    if a.interplay or a.bisect or a.simple_ops or a.sequence:
        mode = "interplay" if a.interplay else "bisect" if a.bisect else "simple_ops" if a.simple_ops else "sequence"
        res[mode] = {"interplay": interplay, "bisect": bisect, "simple_ops": simple_ops, "sequence": sequence}[mode](a)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2))
        return
    for case in a.cases.split(","):
        backend, mode = case.split(":")
        try:
            res["results"].append(one(backend, mode == "whole", a))
        except Exception as e:  # one case failing (e.g. FlashInfer missing) must not lose the others
            res["results"].append({"backend": backend, "whole_step": mode == "whole", "error": f"{type(e).__name__}: {e}"})
            print(f"{case}: {type(e).__name__}: {e}", flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
