"""Engine alone on the CPU: torch's default GEMM against oneDNN packed linears (``EngineConfig.cpu_onednn``).

SmolLM2-135M fp32, 64 prompts of 256 random tokens, 64 new tokens each (ignore_eos), the two settings alternating
for ``--rounds`` rounds in one process; reports output tokens/s and whether the greedy tokens agree.

    python bench/tools/cpu_linear_ab.py --out bench/results/engine_cpu_onednn.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvtide import LLM, SamplingParams  # noqa: E402
from kvtide.benchmarks.header import machine_header  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/engine_cpu_onednn.json")
    a = ap.parse_args(argv)
    r = random.Random(0)
    prompts = [[r.randrange(100, 10000) for _ in range(256)] for _ in range(64)]
    res: dict[str, list] = {}
    tokens: dict[str, list] = {}
    for rnd in range(a.rounds):
        for name, on in (("default", False), ("onednn", True)):
            llm = LLM("smollm2-135m", device="cpu", cpu_onednn=on, cache={"num_pages": 1456},
                      scheduler={"max_num_seqs": 256}, progress=False)
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
            t = time.perf_counter()
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            dt = time.perf_counter() - t
            res.setdefault(name, []).append({"tok_s": 64 * 64 / dt, "seconds": dt})
            tokens.setdefault(name, [o.token_ids for o in outs])
            print(f"{name} round {rnd}: {64 * 64 / dt:.1f} tok/s", flush=True)
    equal = sum(x == y for x, y in zip(tokens["default"], tokens["onednn"]))
    doc = {"header": machine_header(argv), "model": "smollm2-135m", "prompts": 64, "prompt_tokens": 256,
           "new_tokens": 64, "runs": res, "greedy_sequences_equal": f"{equal}/{len(prompts)}"}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"greedy sequences equal: {equal}/{len(prompts)}; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
