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
    assert "top-k identical: True" in text
    assert "sparse_attn" in text
