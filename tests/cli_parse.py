"""Parse a `kvtide ...` command line with the CLI's own argparse (a bench line by its suite's parser too), running
nothing: the docs' example commands are checked this way without starting servers or benchmarks."""
from __future__ import annotations

import argparse
import contextlib
import io
import shlex

import pytest

from kvtide import cli


class _Parsed(BaseException):
    """Raised in place of running a command once its arguments parsed (BaseException: the CLI catches Exception)."""

    def __init__(self, namespace: argparse.Namespace):
        super().__init__()
        self.namespace = namespace


def parse_only(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """The namespace `kvtide argv` parses to. A bench line is dispatched to its suite, whose own parse_args then stops
    it; a line that does not parse fails the test with argparse's message."""
    real = argparse.ArgumentParser.parse_args

    def stop_after_parse(self, args=None, namespace=None):
        ns = real(self, args, namespace)
        if getattr(ns, "cmd", None) == "bench":
            return ns  # the top-level parse of a bench line: cmd_bench hands the rest to the suite's parser
        raise _Parsed(ns)

    err = io.StringIO()
    try:
        with monkeypatch.context() as m, contextlib.redirect_stderr(err):
            m.setattr(argparse.ArgumentParser, "parse_args", stop_after_parse)
            cli.main(argv)
    except _Parsed as p:
        return p.namespace
    except SystemExit as e:
        pytest.fail(f"`kvtide {shlex.join(argv)}` does not parse (exit {e.code}): {err.getvalue().strip()}")
    pytest.fail(f"`kvtide {shlex.join(argv)}` ran instead of stopping at its parse")
