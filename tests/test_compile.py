"""torch.compile of the transformers swap: the swapped attention is torch ops plus the
deepseek_csa operators (torch.ops.deepseek_csa, with fake kernels and autograd formulas),
so a swapped ``DeepseekV4Attention`` compiles with ``fullgraph=True`` and a swapped model
has no graph break of its own.

Most tests compile with the ``aot_eager`` backend: Dynamo traces the module into one
graph, AOTAutograd runs it on fake tensors (our fake kernels) and builds the joint
forward / backward graph (our autograd formulas) -- everything but Inductor's code
generation -- and then runs the very kernels eager runs, in the same order: results are
bitwise eager's (error budget 0).  Inductor (a C++ compile, ~1 min cold on a shared
2-core host) runs only with DEEPSEEK_CSA_SLOW=1; it fuses and reorders the torch ops
around our kernels (float32 rounding of a few ops, budget 1e-5 relative).
"""
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import deepseek_csa.transformers as dch  # noqa: E402

if not dch._supported(transformers.__version__):
    pytest.skip(f"deepseek_csa.transformers supports transformers {dch.SUPPORTED_VERSIONS}, "
                f"found {transformers.__version__}", allow_module_level=True)

from transformers import DynamicCache  # noqa: E402

from test_transformers_bridge import ids_for, make_model  # noqa: E402

SLOW = pytest.mark.skipif(os.environ.get("DEEPSEEK_CSA_SLOW") != "1",
                          reason="Inductor compiles C++ (~1 min cold): DEEPSEEK_CSA_SLOW=1 runs it")
KINDS = ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"]
L3 = ["compressed_sparse_attention", "sliding_attention", "heavily_compressed_attention"]


# one thread each for torch and our kernels: tiny models (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def layer_args(m, S, start, seed):
    """A swapped layer's inputs: hidden states [1, S, hidden], the model's RoPE tables and
    position ids start .. start + S - 1."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(1, S, m.config.hidden_size, generator=g)
    pos = (torch.arange(S) + start)[None]
    pe = {k: m.model.rotary_emb(h, pos, layer_type=k) for k in ("main", "compress")}
    return h, pe, pos


def grads_of(mod, *inputs):
    return [p.grad for p in mod.parameters()] + [x.grad for x in inputs]


def assert_same(a, b, rtol=0.0):
    for x, y in zip(a, b):
        if x is None or y is None:
            # a parameter the step does not reach: None in eager, zeros from a compiled
            # graph that holds it
            assert (x is None or not x.any()) and (y is None or not y.any())
        else:
            if rtol == 0.0:
                assert torch.equal(x, y)
            else:
                assert float((x - y).abs().max()) <= rtol * float(y.abs().max()) + 1e-30


def check_layer(kind, backend, rtol):
    """Prefill (21 tokens) and one decode step into a cache, then forward + backward of a
    prefill without cache and of a decode step after a cached prefill: compiled (one
    graph each) equals swapped eager."""
    m = make_model([kind], seed=3).train()
    a = m.model.layers[0].self_attn
    dch.swap(a)
    f = torch.compile(a, fullgraph=True, backend=backend)
    S = 21
    h, pe, pos = layer_args(m, S, 0, 1)
    h1, pe1, pos1 = layer_args(m, 1, S, 2)
    with torch.no_grad():
        ce, cc = DynamicCache(config=m.config), DynamicCache(config=m.config)
        assert_same([f(h, pe, pos, None, past_key_values=cc)[0]],
                    [a(h, pe, pos, None, past_key_values=ce)[0]], rtol)
        assert_same([f(h1, pe1, pos1, None, past_key_values=cc)[0]],
                    [a(h1, pe1, pos1, None, past_key_values=ce)[0]], rtol)
        if kind != "sliding_attention":
            assert_same([cc.layers[0].compressed_kv["compressor"]],
                        [ce.layers[0].compressed_kv["compressor"]], rtol)

    # forward + backward: a prefill without cache, and a decode step after a prefill
    for cached in (False, True):
        runs = []
        for g in (a, f):
            a.zero_grad(set_to_none=True)
            cache = None
            if cached:
                cache = DynamicCache(config=m.config)
                with torch.no_grad():
                    a(h, pe, pos, None, past_key_values=cache)
                x, xp, xpos = h1.clone().requires_grad_(), pe1, pos1
            else:
                x, xp, xpos = h.clone().requires_grad_(), pe, pos
            out = g(x, xp, xpos, None, past_key_values=cache)[0]
            (out.square().sum()).backward()
            runs.append([out.detach()] + grads_of(a, x))
        assert_same(runs[1], runs[0], rtol)
        assert any(p is not None and p.abs().sum() > 0 for p in runs[0][1:-1])
    dch.unswap(a)


@pytest.mark.parametrize("kind", KINDS)
def test_layer_fullgraph(kind):
    check_layer(kind, "aot_eager", 0.0)


@SLOW
def test_layer_inductor():
    check_layer("compressed_sparse_attention", "inductor", 1e-5)


def _breaks(m, ids, **kw):
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = torch._dynamo.explain(m)(ids, **kw)
    ours = [str(b.reason) for b in e.break_reasons
            if "deepseek_csa" in str(b.reason) or
            any("deepseek_csa" in fr.filename for fr in b.user_stack)]
    return e.graph_break_count, ours


@pytest.mark.parametrize("case", ["no cache", "cache", "padded"])
def test_model_no_graph_break_of_ours(case):
    """A swapped 3-layer model (CSA, sliding, HCA) breaks Dynamo's graph no more
    often than transformers' eager one, and never in deepseek_csa: without a cache, with
    one, and with a padded batch's 2-D mask and per-row position ids (generate()'s)."""
    m = make_model(L3)
    ids = ids_for(2, 40, seed=4)
    kw = dict(use_cache=case != "no cache")
    if case == "padded":
        am = torch.ones(2, 40, dtype=torch.long)
        am[1, :7] = 0
        kw.update(attention_mask=am, position_ids=(am.cumsum(-1) - 1).masked_fill(am == 0, 1))
    with dch.swapped(m):
        swapped, ours = _breaks(m, ids, **kw)
    assert not ours, ours
    if swapped:            # (transformers' own model traces in one graph today)
        assert swapped <= _breaks(m, ids, **kw)[0]


@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
def test_generate_compiled_decode_does_not_recompile_per_step(dynamic):
    """generate() with the swapped model's forward compiled with dynamic shapes
    (``torch.compile(model.forward, dynamic=True)``, and torch.compile's default
    ``dynamic=None``, where a size turns symbolic once it changes; the faster of the two
    in a decode loop, see bench_decode_profile.py): the eager swap's tokens, and the
    decode steps stop compiling once every compressor phase has been seen.  Each step
    grows the caches, but the sizes are symbolic (our index-list operators take the
    positions as SymInt): what is left are a few graphs per phase of the compressors'
    buffers (empty, one row, more; a window completed or not -- Python branches in
    transformers' cache and in the swap), so with ratio 4 the graph count is final
    after two periods and the next 6 steps add none (before the SymInt positions: a new
    graph every step, until Dynamo's recompile limit sent the steps back to eager).
    The Dynamo-only backend keeps the compilations quick."""
    from torch._dynamo.utils import counters
    from transformers import LogitsProcessor, LogitsProcessorList

    class Graphs(LogitsProcessor):
        """The number of graphs compiled so far, read at every generated token."""
        def __init__(self):
            self.seen = []

        def __call__(self, ids, scores):
            self.seen.append(counters["stats"]["unique_graphs"])
            return scores

    m = make_model(["compressed_sparse_attention"], seed=7)
    ids = ids_for(1, 21, seed=5)
    new = 14
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 32
    with torch.no_grad(), dch.swapped(m):
        ref = m.generate(ids, max_new_tokens=new, do_sample=False)
        m.forward = torch.compile(m.forward, backend="eager", dynamic=dynamic)
        counters.clear()
        graphs = Graphs()
        try:
            got = m.generate(ids, max_new_tokens=new, do_sample=False,
                             logits_processor=LogitsProcessorList([graphs]))
        finally:
            del m.forward
            torch._dynamo.config.recompile_limit = limit
    assert torch.equal(got, ref)
    assert len(graphs.seen) == new
    assert graphs.seen[-6] == graphs.seen[-1], graphs.seen
    assert graphs.seen[-1] <= 10, graphs.seen


def test_quantized_compiled_decode_has_no_graph_break():
    """The quantized swapped model (FP8Linear, FP4Experts: the experts keep every routed
    pair at a fixed shape) compiled with ``torch.compile(model.forward, dynamic=True)``:
    generate() gives the eager model's tokens, and Dynamo never breaks a graph -- every
    prefill and decode step runs as one graph (before the fixed-shape experts: a break
    at every MoE layer, 14 a decode step of this model).  The Dynamo-only backend keeps
    it quick."""
    from test_quantized import make_model128
    from torch._dynamo.utils import counters
    m = make_model128(dtype=torch.bfloat16)
    dch.quantize(m)
    ids = ids_for(1, 9, seed=8)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 32
    with torch.no_grad(), dch.swapped(m):
        ref = m.generate(ids, max_new_tokens=3, do_sample=False)
        m.forward = torch.compile(m.forward, backend="eager", dynamic=True)
        counters.clear()
        try:
            got = m.generate(ids, max_new_tokens=3, do_sample=False)
        finally:
            del m.forward
            torch._dynamo.config.recompile_limit = limit
    assert torch.equal(got, ref)
    assert counters["stats"]["unique_graphs"] > 0
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_training_compiled_model():
    """torch.compile(model) + loss.backward(), swapped: the swapped eager loss and
    gradients (the same kernels; AOTAutograd's backward of the torch ops around them may
    sum in another order: budget 1e-5 norm-wise per parameter)."""
    m = make_model(["compressed_sparse_attention", "heavily_compressed_attention"], seed=9).train()
    ids = ids_for(2, 30, seed=6)
    runs = []
    with dch.swapped(m):
        for g in (m, torch.compile(m, backend="aot_eager")):
            m.zero_grad(set_to_none=True)
            loss = g(ids, labels=ids).loss
            loss.backward()
            runs.append((float(loss.detach()),
                         {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (le, ge), (lc, gc) = runs
    assert abs(lc - le) <= 1e-6 * abs(le)
    assert ge.keys() == gc.keys()
    assert any("self_attn.compressor.kv_proj" in n for n in ge)
    for n in ge:
        nb = float(ge[n].norm())
        assert float((gc[n] - ge[n]).norm()) <= 1e-5 * nb + 1e-30, n
