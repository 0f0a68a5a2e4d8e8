"""examples/swap_layers.ipynb is executed top to bottom (nbclient), so it cannot rot: its
own assertions check every swapped layer within 1e-4 of the unswapped run."""
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="nbformat is needed to run the notebook")
nbclient = pytest.importorskip("nbclient", reason="nbclient is needed to run the notebook")
pytest.importorskip("ipykernel", reason="ipykernel is needed to run the notebook")

NB = Path(__file__).resolve().parents[1] / "examples" / "swap_layers.ipynb"


def test_swap_layers_notebook_runs():
    nb = nbformat.read(NB, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB.parent)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    # the swap report: one line per layer, each swapped layer within QAT_TOL (1e-5; the
    # notebook's own assertion is the looser 1e-4 it shows its readers), the other
    # layers unchanged, top-k identical
    import re
    rows = re.findall(r"layer (\d) \(ratio +\d+\) swapped: its output moved (\S+) \(relative\), "
                      r"other layers (\S+), top-k identical: (\w+)", text)
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], text[-2000:]
    for _, own, other, topk in rows:
        assert 0 < float(own) < 1e-5 and float(other) == 0 and topk == "True", (own, other, topk)
    # the speed table timed our sparse_attn against the torch reference
    assert re.search(r"^sparse_attn +torch +[\d.]+ ms +deepseek_csa +[\d.]+ ms", text, re.M), text[-2000:]


TRAIN_NB = NB.parent / "train_indexer.ipynb"


def _standin_cell():
    """A first cell that patches the plain-torch stand-in ops (tests/_grad_standin.py)
    onto deepseek_csa.torch, for the 'standin' mode."""
    tests = str(Path(__file__).resolve().parent)
    root = str(Path(__file__).resolve().parents[1])
    return nbformat.v4.new_code_cell(
        f"import sys; sys.path[:0] = [{root!r}, {tests!r}]\n"
        "import deepseek_csa.torch as _dct, _grad_standin as _g\n"
        "for _n in _g.NAMES: setattr(_dct, _n, getattr(_g, _n))")


@pytest.mark.parametrize("ops", ["standin", "real"])
def test_train_indexer_notebook_runs(ops):
    """examples/train_indexer.ipynb: the indexer's KL training (dense warm-up, sparse
    stage) improves its top-k recall.  'real' needs deepseek_csa.torch's differentiable
    ops (skipped without them); 'standin' runs it on tests/_grad_standin.py."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _grad_standin import real_ops_available
    if ops == "real" and not real_ops_available():
        pytest.skip("deepseek_csa.torch has no differentiable ops in this build yet")
    nb = nbformat.read(TRAIN_NB, as_version=4)
    if ops == "standin":
        nb.cells.insert(0, _standin_cell())
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NB.parent)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "indexer recall improved: True" in text
    assert "are all the indexers': True" in text
