"""Python mutants of the transformers training path (deepseek_csa/transformers.py):
each ``apply()`` plants one realistic bug; tests/test_grad_transformers.py must fail
with every one of them (in the 'standin' mode today, in both modes once the real
differentiable ops land).  Run one by hand:

    CSA_PY_MUTANT=m_grad_transformers:<name> .venv/bin/python -m pytest -q \\
        tests/test_grad_transformers.py -x
"""

TARGETS = ["tests/test_grad_transformers.py"]


class _OpsProxy:
    """deepseek_csa.torch as the swap sees it, with some ops replaced (the others are
    resolved on the real module at call time, so the tests' stand-in still applies)."""

    def __init__(self, **over):
        self._over = over

    def __getattr__(self, name):
        import deepseek_csa.torch as dct
        f = self._over.get(name)
        if f is None:
            return getattr(dct, name)
        return lambda *a, **k: f(getattr(dct, name), *a, **k)


def _proxy(**over):
    import deepseek_csa.transformers as dch
    dch._dct = lambda: _OpsProxy(**over)


def _sink_no_grad():
    _proxy(sparse_attn=lambda real, q, kv, sink, idx, sc: real(q, kv, sink.detach(), idx, sc))


def _compressor_detached():
    _proxy(gated_pool=lambda real, kv, score, ratio, **k: real(kv.detach(), score, ratio, **k))


def _gate_detached():
    def f(real, kv, score, ratio, ape=None, **k):
        return real(kv, score.detach(), ratio, ape=None if ape is None else ape.detach(), **k)
    _proxy(gated_pool=f)


def _no_ape():
    _proxy(gated_pool=lambda real, kv, score, ratio, ape=None, **k: real(kv, score, ratio, **k))


def _out_rope_not_inverted():
    _proxy(apply_rotary_emb=lambda real, x, f, inverse=False: real(x, f, inverse=False))


def _capture_not_detached():
    import deepseek_csa.transformers as dch
    dch._indexer_inputs = lambda h, qr: (h, qr)


def _ste_zero():
    import deepseek_csa.transformers as dch
    real = dch._ste

    def ste(x, fn):
        return real(x, fn) * 0 + real(x, fn).detach()
    dch._ste = ste


def _target_window_slots():
    import deepseek_csa.transformers as dch
    real = dch._capture_target

    def f(st, m, rec, q, kvbuf, idx, pos, off, T):
        real(st, m, rec, q, kvbuf, idx, pos, off, T)
        K = rec.topk_idxs.shape[-1]
        import deepseek_csa.torch as dct
        import torch
        w = dct.sparse_attn_weights(q.detach(), kvbuf.detach(), m.sinks.detach().float(),
                                    torch.from_numpy(idx), float(m.scaling))
        rec.attn_target = w[..., :K].contiguous()
    dch._capture_target = f


MUTANTS = [
    dict(name="sink_no_grad", kind="py", targets=TARGETS, apply=_sink_no_grad,
         what="the attention sink gets no gradient (detached before sparse_attn)"),
    dict(name="compressor_detached", kind="py", targets=TARGETS, apply=_compressor_detached,
         what="the compressor's pooled kv is detached in the backward path"),
    dict(name="gate_detached", kind="py", targets=TARGETS, apply=_gate_detached,
         what="the compressor's gate scores / position_bias get no gradient"),
    dict(name="no_ape", kind="py", targets=TARGETS, apply=_no_ape,
         what="the compressor's position_bias (ape) is dropped in the training path"),
    dict(name="out_rope_not_inverted", kind="py", targets=TARGETS,
         apply=_out_rope_not_inverted,
         what="the attention output's rope tail is rotated forward instead of back"),
    dict(name="capture_not_detached", kind="py", targets=TARGETS,
         apply=_capture_not_detached,
         what="the indexer capture's inputs stay on the main graph (KL reaches the model)"),
    dict(name="ste_zero", kind="py", targets=TARGETS, apply=_ste_zero,
         what="QAT roundings pass no gradient instead of straight-through"),
    dict(name="target_window_slots", kind="py", targets=TARGETS, apply=_target_window_slots,
         what="the indexer's attention target is read from the window slots"),
]
