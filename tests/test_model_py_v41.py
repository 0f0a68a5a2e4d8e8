"""DeepSeek's released V4.1-Flash ``inference/model.py``, swapped onto deepseek_csa layer
by layer, and what it does on decode steps that end inside a compressor group.

The file is found by ``released_files.v41_model_py()`` (``<repo>/../shared/reference/
deepseek-v41/inference/model.py`` or ``DEEPSEEK_MODEL_PY_V41``; the tests skip, saying
where they looked, when it is absent) and imported with the test stand-ins of the
modules it imports but that are not published with it (tests/v41_standins).

A tiny random-weight float32 model, six layers with every V4.1 role: a window-only
layer (0), a ratio-2 kv + index source (1) and its reader (2), a ratio-1 kv + index +
candidate source (3), a ratio-1 reader (4) and a level-two index layer scoring inside
the candidate blocks (5).  ``index_topk`` (8) is below the number of visible
compressed entries, so the selections matter.  Unswapped runs use the float32
reference kernels (deepseek_csa.reference, never our kernels) for everything model.py
imports, so a swapped layer is compared with an independent reference.

Error budget: float32 alone, a swapped layer against the unswapped one: measured
3e-7 .. 5e-7 relative (other summation orders); QAT_TOL = 1e-5.  A decode step against
the prefill of the same tokens, QAT off: measured <= 2e-6 relative on the logits where
both compute the same thing; DECODE_TOL = 1e-4 (x50).  The released file's stale index
keys move the logits by 1e-2 .. 5e-1 relative (docs/layers.md), far outside it.
"""
import contextlib
import copy

import pytest
import torch

import ref_layer as R
import released_files as rf

import deepseek_csa.torch as dct
from deepseek_csa.reference import kernel_module as KM

QAT_TOL = 1e-5
DECODE_TOL = 1e-4
STALE_MIN = 1e-2     # the smallest change the stale keys make at a mid-group step (measured >= 3e-2)

CFG = dict(max_batch_size=2, max_seq_len=128, temperature=0.0, dtype="bf16", expert_dtype=None,
           vocab_size=256, dim=256, moe_inter_dim=128, n_layers=6, n_mtp_layers=0, n_heads=8,
           n_routed_experts=4, n_activated_experts=2, q_lora_rank=64, head_dim=128,
           rope_head_dim=64, o_groups=4, o_lora_rank=32, window_size=16,
           compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3),
           index_source_layers=(1, 3, 5), candidate_source_layer=3,
           candidate_topk_blocks=3, candidate_block_size=4,
           compress_rope_theta=160000.0, original_seq_len=65536, rope_factor=16,
           index_n_heads=8, index_head_dim=64, index_topk=8, hc_mult=2)


@pytest.fixture(scope="module")
def v41():
    return rf.load_v41(rf.v41_model_py())


def _no_round(x, *a, inplace=None, **kw):
    """act_quant / fp4_act_quant with the QAT rounding off: the in-place forms return x
    unchanged (the only forms a bf16-weight model calls)."""
    return x


def _refs(qat):
    return {"act_quant": KM.act_quant if qat else _no_round,
            "fp4_act_quant": R.fp4_act_quant if qat else _no_round,
            "sparse_attn": R.sparse_attn, "hc_split_sinkhorn": KM.hc_split_sinkhorn}


@contextlib.contextmanager
def reference_kernels(mod, qat=True):
    """What the file imports from kernel_cpu replaced by the float32 references (QAT
    rounding on or off) while the block runs; swapped layers still run deepseek_csa."""
    G = vars(mod)
    refs = _refs(qat)
    saved = {n: G[n] for n in refs}
    G.update(refs)
    mod.shared_attn.__init__()     # one model after another: start from a clean slate
    try:
        yield
    finally:
        G.update(saved)


@contextlib.contextmanager
def republishing(mod):
    """The consistent behaviour, on the released file: an index-key owner publishes its
    key cache on every call, not only on calls where its compressor emits an entry."""
    orig = mod.Indexer.forward

    def forward(self, x, qr, latent, start_pos, offset):
        if self.owns_k:
            mod.shared_attn.index_k = self.k_cache
        return orig(self, x, qr, latent, start_pos, offset)

    mod.Indexer.forward = forward
    try:
        yield
    finally:
        mod.Indexer.forward = orig


def build(mod, seed=0):
    args = mod.ModelArgs(**CFG)
    model = mod.Transformer(args)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("norm.weight"):
                v = 1 + 0.1 * torch.randn(shape, generator=g)
            elif "hc_" in name:
                v = 0.1 * torch.randn(shape, generator=g)
            elif p.dim() == 2 and "embed" not in name:
                v = torch.randn(shape, generator=g) * shape[1] ** -0.5
            elif name.endswith("gate.bias"):
                v = torch.zeros(shape)
            else:
                v = torch.randn(shape, generator=g)
            p.data = v.float()   # float32 run (dtype "bf16": no FP8 / FP4 weights)
    return model, args


def tokens(n, seed=1):
    return torch.randint(0, CFG["vocab_size"], (2, n), generator=torch.Generator().manual_seed(seed))


# every op but the QAT rounding (V4.1 has no Hadamard rotation to route either)
NO_QAT_OPS = [o for o in dct.OPS if o not in ("qat", "hadamard")]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


# ----------------------------------------------------------------------------- swap
def test_v41_swap_each_layer_into_released_model(v41):
    """Each layer in turn swapped (window-only, ratio-2 source and reader, ratio-1
    candidate source and reader, level-two index layer): a 21-token prefill (a ratio-2
    group left open) and 5 decode steps, QAT on, batch 2.  The swapped layer within
    QAT_TOL (qat_close), every other layer unchanged, every top-k set identical."""
    base, args = build(v41)
    ids = tokens(40)
    S, steps = 21, 5

    def run(m):
        v41.shared_attn.__init__()
        m(ids[:, :S], 0)
        for p in range(S, S + steps):
            m(ids[:, p:p + 1], p)

    with reference_kernels(v41):
        report = R.swap_report(lambda: copy.deepcopy(base), run)
    assert [r["layer"] for r in report] == list(range(args.n_layers))
    for r in report:
        assert r["ok"] and r["topk_equal"], r
        assert all(e == 0 for l, e in r["per_layer"].items() if l != r["layer"]), r
    assert all(r["per_layer"][r["layer"]] > 0 for r in report)   # ours really ran


def test_v41_swap_routes_every_role(v41):
    base, _ = build(v41)
    with dct.swap(base) as sw:
        routed = sw.routed
    assert "indexer" in routed[1] and "compressor" in routed[1]       # ratio-2 source
    assert "indexer" not in routed[2] and "compressor" not in routed[2]  # reader
    assert "indexer" in routed[3] and "compressor" in routed[3]       # candidate source
    assert "indexer" in routed[5] and "compressor" not in routed[5]   # level two
    assert "sparse_attn" in routed[0]


# ----------------------------------------------------------------------------- mid-group decode
def one_step_vs_prefill(v41, make, p, ids, ctx=contextlib.nullcontext):
    """Logits of one decode step at position p after a prefill of p tokens, and of a
    prefill of the same p + 1 tokens: every cache the step reads comes from a prefill,
    so only the step itself can differ."""
    with ctx(), torch.no_grad():
        v41.shared_attn.__init__()
        m = make()
        m(ids[:, :p], 0)
        dec = m(ids[:, p:p + 1], p)[1]
        v41.shared_attn.__init__()
        pre = make()(ids[:, :p + 1], 0)[1]
    return dec, pre


def decode_run(v41, m, ids, p0, steps, ctx=contextlib.nullcontext):
    """Logits of a prefill of p0 tokens and the decode steps p0 .. p0 + steps - 1."""
    out = {}
    with ctx(), torch.no_grad():
        v41.shared_attn.__init__()
        m(ids[:, :p0], 0)
        for p in range(p0, p0 + steps):
            out[p] = m(ids[:, p:p + 1], p)[1].clone()
    return out


@pytest.mark.parametrize("qat", [False, True], ids=["qat_off", "qat_on"])
def test_v41_released_decode_mid_group_differs_from_prefill(v41, qat):
    """The released file on its own.  One decode step after a prefill, at positions
    ending on either offset of a ratio-2 group: a step that completes a group equals the
    prefill of the same tokens; a step that ends inside one does not (its ratio-2 index
    layers score against the ratio-1 owner's keys published on the step before).  QAT
    off the agreement is float32 noise (DECODE_TOL); QAT on, a flipped FP4 / FP8 rounding
    may add a step of its grid (2e-3 relative) to the complete-group steps."""
    base, _ = build(v41)
    ids = tokens(40)
    with reference_kernels(v41, qat=qat):
        for p in (30, 31):    # 31 tokens end inside a ratio-2 group, 32 complete one
            dec, pre = one_step_vs_prefill(v41, lambda: copy.deepcopy(base), p, ids)
            err = _rel(dec, pre)
            if (p + 1) % 2 == 0:
                assert err < (DECODE_TOL if not qat else 5e-3), (p, err)
            else:
                assert err > STALE_MIN, (p, err)


def test_v41_republishing_decode_equals_prefill_at_every_offset(v41):
    """The consistent behaviour (owners publish their keys on every call; the test's
    ``republishing`` over the released file): decode equals prefill at every offset, one
    step after a prefill and over a run of 6 decode steps, QAT off."""
    base, _ = build(v41)
    ids = tokens(40)
    with reference_kernels(v41, qat=False), republishing(v41):
        for p in (30, 31):
            dec, pre = one_step_vs_prefill(v41, lambda: copy.deepcopy(base), p, ids)
            assert _rel(dec, pre) < DECODE_TOL, p
        run = decode_run(v41, copy.deepcopy(base), ids, 30, 6)
        for p, got in run.items():
            v41.shared_attn.__init__()
            with torch.no_grad():
                want = copy.deepcopy(base)(ids[:, :p + 1], 0)[1]
            assert _rel(got, want) < DECODE_TOL, p


def test_v41_released_decode_run_carries_the_error(v41):
    """Over a run of decode steps the released file's mid-group error does not stay in
    its step: the wrong output lands in the window KV and the compressed entries of the
    layers after it, so every later step differs from the prefill too, complete-group
    steps included (QAT off)."""
    base, _ = build(v41)
    ids = tokens(40)
    with reference_kernels(v41, qat=False):
        run = decode_run(v41, copy.deepcopy(base), ids, 30, 4)
        for p, got in run.items():
            v41.shared_attn.__init__()
            with torch.no_grad():
                want = copy.deepcopy(base)(ids[:, :p + 1], 0)[1]
            assert _rel(got, want) > STALE_MIN, p


def test_v41_swap_stays_exact_to_released_mid_group(v41):
    """``swap`` reproduces the released file, its mid-group behaviour included: every
    layer swapped, decode steps at both offsets of a ratio-2 group (and the run that
    carries the error on) give the released logits within QAT_TOL, QAT off (the swapped
    layers keep the model's own no-rounding act_quant)."""
    base, _ = build(v41)
    ids = tokens(40)
    with reference_kernels(v41, qat=False):
        want = decode_run(v41, copy.deepcopy(base), ids, 29, 6)
        m = copy.deepcopy(base)
        with dct.swap(m, ops=NO_QAT_OPS):
            got = decode_run(v41, m, ids, 29, 6)
        for p in want:
            assert _rel(got[p], want[p]) < QAT_TOL, p
        for p in (30, 31):
            mk = lambda: copy.deepcopy(base)  # noqa: E731
            d_rel, _ = one_step_vs_prefill(v41, mk, p, ids)

            def swapped():
                s = copy.deepcopy(base)
                dct.swap(s, ops=NO_QAT_OPS)
                return s
            d_sw, _ = one_step_vs_prefill(v41, swapped, p, ids)
            assert _rel(d_sw, d_rel) < QAT_TOL, p


# ----------------------------------------------------------------------------- measurement
def measure(p_first=28, n=8):
    """The docs/layers.md table: per decode position p, the logits of one decode step
    after a prefill of p tokens (and of step p of a run of decode steps after a prefill
    of p_first tokens) against the prefill of the same p + 1 tokens; max |diff| and
    max |diff| / max |prefill|, for the released file on the reference kernels (QAT off
    and on), with every layer swapped, and with the test's republishing."""
    v41 = rf.load_v41(rf.v41_model_py())
    base, _ = build(v41)
    ids = tokens(p_first + n + 1)
    mk = lambda: copy.deepcopy(base)  # noqa: E731

    def swapped():
        s = copy.deepcopy(base)
        dct.swap(s, ops=NO_QAT_OPS)
        return s

    sides = [("released, QAT off", False, mk, contextlib.nullcontext),
             ("released, QAT on", True, mk, contextlib.nullcontext),
             ("swapped, QAT off", False, swapped, contextlib.nullcontext),
             ("republishing, QAT off", False, mk, lambda: republishing(v41))]
    rows = {}
    for name, qat, make, ctx in sides:
        with reference_kernels(v41, qat=qat), ctx():
            run = decode_run(v41, make(), ids, p_first, n)
            for p in range(p_first, p_first + n):
                dec, pre = one_step_vs_prefill(v41, make, p, ids)
                d1, dr = (dec - pre).abs().max(), (run[p] - pre).abs().max()
                m = pre.abs().max()
                rows.setdefault(p, []).append((float(d1), float(d1 / m), float(dr), float(dr / m)))
    print("p (tokens p+1, (p+1) mod 2) | " + " | ".join(
        f"{n}: step abs / rel, run abs / rel" for n, *_ in sides))
    for p, r in rows.items():
        print(f"{p} ({p + 1}, {(p + 1) % 2}) | " + " | ".join(
            f"{a:.1e} / {b:.1e}, {c:.1e} / {d:.1e}" for a, b, c, d in r))


if __name__ == "__main__":      # python tests/test_model_py_v41.py: the table of docs/layers.md
    measure()
