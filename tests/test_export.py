"""torch.export of the transformers swap: a swapped DeepseekV4ForCausalLM and a swapped
DeepseekV4Attention export (non-strict), the ExportedProgram holds torch.ops.deepseek_csa
operators, runs, equals the swapped eager model, and ``torch.export.save`` / ``load``
round-trips in a fresh process that imports ``deepseek_csa.torch`` (which registers the
operators).  The program runs the very kernels eager runs, in the same order: error
budget 0 (bitwise).

The model's routed experts run on transformers' own custom operator
(torch.ops.transformers.grouped_mm_fallback; its "eager" experts loop over a
data-dependent set and do not export): the loading process imports
transformers.integrations.moe for that one, nothing else of transformers."""
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as dch  # noqa: E402

if not dch._supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers supports transformers {dch.SUPPORTED_VERSIONS}, "
                f"found {transformers.__version__}", allow_module_level=True)

from test_transformers_bridge import ids_for, make_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
L5 = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
      "compressed_sparse_attention", "heavily_compressed_attention"]


# one thread each for torch and our kernels: tiny models (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def our_ops(ep):
    """The deepseek_csa operators an ExportedProgram's graph calls (directly or as the
    mutating op inside an auto_functionalized node)."""
    names = set()
    for n in ep.graph.nodes:
        for t in (n.target, *n.args):
            s = str(t)
            if "deepseek_csa" in s and "." in s:
                names.add(s.split("deepseek_csa.")[-1].split(".")[0])
    return names


def export(mod, args, kwargs=None):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(mod, args, kwargs or {}, strict=False)


def test_export_model_and_layer_round_trip(tmp_path):
    m = make_model(L5, seed=11)
    ids = ids_for(2, 40, seed=12)
    with dch.swapped(m):
        ep = export(m, (ids,), {"use_cache": False})
        with torch.no_grad():
            ref = m(ids, use_cache=False).logits
            got = ep.module()(ids, use_cache=False).logits
    assert {"sparse_attn", "index_topk", "gated_pool", "rms_norm", "hc_split_sinkhorn"} <= \
        our_ops(ep), our_ops(ep)
    assert torch.equal(got, ref)

    # one swapped CSA attention layer on its own (no cache)
    a = m.model.layers[1].self_attn
    S = 29
    h = torch.randn(2, S, m.config.hidden_size, generator=torch.Generator().manual_seed(13))
    pos = torch.arange(S)[None]
    pe = {k: m.model.rotary_emb(h, pos, layer_type=k) for k in ("main", "compress")}
    with dch.swapped(a):
        lp = export(a, (h, pe, pos, None))
        with torch.no_grad():
            lref = a(h, pe, pos, None)[0]
            lgot = lp.module()(h, pe, pos, None)[0]
    assert {"sparse_attn", "index_topk", "gated_pool"} <= our_ops(lp)
    assert torch.equal(lgot, lref)

    torch.export.save(ep, tmp_path / "model.pt2")
    torch.export.save(lp, tmp_path / "layer.pt2")
    torch.save(dict(ids=ids, ref=ref, h=h, pe=pe, pos=pos, lref=lref), tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch
        import deepseek_csa.torch  # registers torch.ops.deepseek_csa
        import transformers.integrations.moe  # registers torch.ops.transformers (experts)
        io = torch.load({str(tmp_path / "io.pt")!r})
        ep = torch.export.load({str(tmp_path / "model.pt2")!r})
        lp = torch.export.load({str(tmp_path / "layer.pt2")!r})
        with torch.no_grad():
            got = ep.module()(io["ids"], use_cache=False).logits
            lgot = lp.module()(io["h"], io["pe"], io["pos"], None)[0]
        assert torch.equal(got, io["ref"]), float((got - io["ref"]).abs().max())
        assert torch.equal(lgot, io["lref"]), float((lgot - io["lref"]).abs().max())
        print("round trip ok")
    """)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "round trip ok" in r.stdout, r.stderr[-3000:]
