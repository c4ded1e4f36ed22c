"""What every `kvtide bench` suite writes: JSON that opens with the machine/versions header, and a PNG beside it.

A suite builds its result as a dict and hands it to :func:`write` with its ``draw(doc, plt) -> Figure`` (the
headline figure). The header (python, torch, device, kvtide's git rev, date, argv) comes from
:func:`kvtide.benchmarks.header.machine_header`. Where matplotlib is missing (a bare GPU host) the JSON is still
written and the PNG can be drawn later from it, on any machine:

    python bench/report.py zip-attention bench/results/zip_attention.json    # -> zip_attention.png beside it
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvtide.benchmarks.header import machine_header  # noqa: E402
from kvtide.log import get_logger  # noqa: E402

log = get_logger("bench")
Draw = Callable[[dict, Any], Any]  # (result, matplotlib.pyplot) -> Figure


def with_header(doc: dict, argv: list[str] | None = None) -> dict:
    """``doc`` with the machine/versions header as its first key (an existing ``header`` is replaced)."""
    return {"header": machine_header(argv), **{k: v for k, v in doc.items() if k != "header"}}


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend; None (logged, with the install command) where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        log.warning("matplotlib is not installed: no PNG (pip install 'kvtide[bench]'; then "
                    "python bench/report.py SUITE RESULT.json draws it from the JSON)")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png_path(json_path: Path | str) -> Path:
    return Path(json_path).with_suffix(".png")


def write_png(doc: dict, path: Path | str, draw: Draw) -> Path | None:
    """Draw ``doc``'s headline figure into ``path``; None where matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return None
    fig = draw(doc, plt)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return Path(path)


def write(path: Path | str, doc: dict, draw: Draw | None = None, argv: list[str] | None = None,
          png: bool = True, **json_kw: Any) -> dict:
    """Write ``doc`` with the header to ``path`` (JSON) and, with ``draw`` and ``png``, its PNG beside it.
    Returns what was written. ``json_kw`` goes to :func:`json.dumps` (default: indent=1)."""
    out = with_header(doc, argv)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, **({"indent": 1} | json_kw)) + "\n")
    if draw is not None and png:
        write_png(out, png_path(path), draw)
    return out


def load_suite(path: Path | str):
    """Import a bench/ script by its stem with its folder and the repository on sys.path (as `kvtide bench` does)."""
    path = Path(path)
    for p in (str(ROOT), str(path.parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    return importlib.import_module(path.stem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="draw a suite's PNG from its JSON result")
    ap.add_argument("suite", help="a `kvtide bench` suite name (zip-attention) or a bench/ script path")
    ap.add_argument("result", type=Path, help="the suite's JSON result")
    ap.add_argument("--out", type=Path, help="PNG path (default: beside the JSON)")
    a = ap.parse_args(argv)
    from kvtide.cli import BENCH_SUITES

    target = BENCH_SUITES.get(a.suite, a.suite)
    if target.endswith(".py"):
        mod = load_suite(ROOT / "bench" / target if not Path(target).exists() else Path(target))
    else:
        mod = importlib.import_module(target)
    if not hasattr(mod, "draw"):
        raise SystemExit(f"{a.suite} has no draw(doc, plt)")
    out = write_png(json.loads(a.result.read_text()), a.out or png_path(a.result), mod.draw)
    print(out or "no PNG (matplotlib missing)")
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
