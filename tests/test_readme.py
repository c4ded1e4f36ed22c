"""The README's examples work as written.

Its ```python blocks run against the bundled model (those that talk to ``127.0.0.1:8000`` against a live
`kvtide serve` app on a free port); its ``curl`` lines are sent to that app; its ``kvtide ...`` lines are parsed by the
CLI's own argparse (a bench line by its suite's parser too) without running anything; ``make`` targets and
``pip install`` extras it names exist, and its table of extras matches pyproject.toml.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tests.cli_parse import parse_only

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SERVER = "127.0.0.1:8000"  # the address the README's server examples use
MODEL = "smollm2-135m"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def shell_lines(program: str) -> list[list[str]]:
    """Each line of the README's bash blocks that runs ``program``, split as the shell would (comments dropped)."""
    out = []
    for block in blocks("bash"):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == program:
                out.append(argv)
    return out


def extras() -> dict[str, list[str]]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


VLLM_BLOCKS = [b for b in blocks("python") if "from vllm" in b]  # run in vLLM's venv: tests/integrations
LOCAL_BLOCKS = [b for b in blocks("python") if SERVER not in b and b not in VLLM_BLOCKS]
SERVER_BLOCKS = [b for b in blocks("python") if SERVER in b]


def test_readme_has_the_examples():
    assert LOCAL_BLOCKS and SERVER_BLOCKS and VLLM_BLOCKS and shell_lines("kvtide") and shell_lines("curl")
    assert len(README.encode()) <= 12 * 1024, "the README is one page (<= 12 KB): move detail to docs/"


@pytest.mark.parametrize("code", LOCAL_BLOCKS, ids=lambda c: c.splitlines()[0][:40])
def test_python_example_runs(code):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert printed.getvalue().strip(), "the example prints what it shows"


@pytest.mark.parametrize("argv", shell_lines("kvtide"), ids=lambda a: " ".join(a[1:4]))
def test_cli_line_parses(argv, monkeypatch):
    ns = parse_only(argv[1:], monkeypatch)
    if argv[1] != "bench":
        assert ns.cmd == argv[1]


def test_parse_only_rejects_a_bad_line(monkeypatch):
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        parse_only(["generate", "Hi", "--no-such-flag"], monkeypatch)


def test_make_targets_exist():
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    for argv in shell_lines("make"):
        assert set(argv[1:]) <= targets, f"`{shlex.join(argv)}`: the Makefile has {sorted(targets)}"


def test_pip_extras_exist():
    named = {e for argv in shell_lines("pip") for a in argv if (m := re.search(r"\[(.*)\]", a))
             for e in m.group(1).split(",")}
    table = set(re.findall(r"^\| `(\w+)` \|", README, flags=re.M))
    assert named <= set(extras()), f"pip lines name extras pyproject.toml lacks: {sorted(named - set(extras()))}"
    assert table == set(extras()), f"README's extras table {sorted(table)} != pyproject.toml's {sorted(extras())}"


@pytest.fixture(scope="module")
def server():
    """``host:port`` of a live `kvtide serve` app over the bundled model, on loopback."""
    from kvtide.benchmarks.procs import free_port
    from kvtide.engine.llm import LLM
    from kvtide.server.app import build_app
    from kvtide.server.config import ServerConfig
    from tests.server.app_thread import app_thread

    llm = LLM(MODEL, device="cpu", cache={"num_pages": 256}, progress=False)
    cfg = ServerConfig(port=free_port(), log_stats_interval_s=0)
    with app_thread(build_app(llm, cfg), cfg.port):
        yield f"127.0.0.1:{cfg.port}"
    llm.loop.stop()


@pytest.mark.parametrize("code", SERVER_BLOCKS, ids=lambda c: c.splitlines()[0][:40])
def test_server_example_runs(code, server):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(SERVER, server), "README.md", "exec"), {"__name__": "readme"})
    assert printed.getvalue().strip()


def _curl(argv: list[str]) -> tuple[str, dict[str, str], str | None]:
    url, headers, data = None, {}, None
    it = iter(argv[1:])
    for a in it:
        if a == "-H":
            k, v = next(it).split(":", 1)
            headers[k.strip()] = v.strip()
        elif a == "-d":
            data = next(it)
        elif not a.startswith("-"):
            url = a
    assert url, f"no URL in {argv}"
    return url, headers, data


@pytest.mark.parametrize("argv", shell_lines("curl"), ids=lambda a: a[1])
def test_curl_line_is_answered(argv, server):
    import httpx

    url, headers, data = _curl(argv)
    url = url.replace(SERVER, server)
    with httpx.Client(timeout=120) as http:
        r = http.post(url, headers=headers, content=data) if data is not None else http.get(url)
    assert r.status_code == 200, r.text
    if data is not None:
        assert json.loads(r.text)["choices"][0]["text"]


def _resolve(dotted: str) -> object:
    """The object a dotted name like ``kvtide.restore.planner.plan`` names (module prefix imported, rest getattr)."""
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("dotted", sorted(set(re.findall(r"`(kvtide(?:\.\w+)+)", README))))
def test_named_api_exists(dotted):
    assert _resolve(dotted) is not None


@pytest.mark.parametrize("link", sorted(set(re.findall(r"\]\(((?:docs|bench)/[^)#]*)\)", README))))
def test_linked_file_exists(link):
    assert (ROOT / link).exists(), link
