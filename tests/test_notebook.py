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
