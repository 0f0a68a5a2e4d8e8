"""Progress bars only on a terminal (issue 29): off a terminal the demo's stages print
one line each when done, no tqdm redraws (carriage returns) in a log."""
import io
import sys

from deepseek_csa import demo


def test_no_bar_off_a_terminal(monkeypatch):
    err = io.StringIO()            # not a tty
    monkeypatch.setattr(sys, "stderr", err)
    for _ in demo._bar(range(5), desc="decode", leave=False):
        pass
    with demo._bar(total=1, desc="prefill 8 tokens", leave=False) as b:
        b.update()
    lines = err.getvalue().splitlines()
    assert "\r" not in err.getvalue()
    assert len(lines) == 2 and lines[0].startswith("decode: done in ") and \
        lines[1].startswith("prefill 8 tokens: done in "), lines


def test_bar_on_a_terminal(monkeypatch):
    import pytest
    tqdm = pytest.importorskip("tqdm")

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stderr", Tty())
    b = demo._bar(range(3), desc="x")
    assert isinstance(b, tqdm.tqdm)
    list(b)
