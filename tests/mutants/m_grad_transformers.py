"""Python mutants of the transformers training path (deepseek_csa/transformers/, the
one attention path that autograd records in training): each ``apply()`` plants one
realistic bug; tests/test_grad_transformers.py must fail with every one of them.  Run
one by hand:

    CSA_PY_MUTANT=m_grad_transformers:<name> .venv/bin/python -m pytest -q \\
        tests/test_grad_transformers.py -x
"""

TARGETS = ["tests/test_grad_transformers.py"]


def _patch_call(**over):
    """The bridge calls every operator through its attention module's ``_call``: the
    named ones become over[name](real _call, *args)."""
    import deepseek_csa.transformers.attention as dch
    real = dch._call

    def call(name, *args):
        f = over.get(name)
        return real(name, *args) if f is None else f(real, *args)
    dch._call = call


def _sink_no_grad():
    _patch_call(sparse_attn=lambda real, q, kv, sink, idx, sc:
                real("sparse_attn", q, kv, sink.detach(), idx, sc))


def _compressor_detached():
    _patch_call(gated_pool=lambda real, kv, score, ratio, ape, ov:
                real("gated_pool", kv.detach(), score, ratio, ape, ov))


def _gate_detached():
    _patch_call(gated_pool=lambda real, kv, score, ratio, ape, ov:
                real("gated_pool", kv, score.detach(), ratio, ape, ov))


def _no_ape():
    # the compressors pool without their position_bias
    import torch
    import deepseek_csa.transformers.attention as dch
    real = dch._compress

    def compress(mod, *a, **k):
        saved = mod._parameters["position_bias"]
        mod._parameters["position_bias"] = torch.nn.Parameter(torch.zeros_like(saved),
                                                              saved.requires_grad)
        try:
            return real(mod, *a, **k)
        finally:
            mod._parameters["position_bias"] = saved
    dch._compress = compress


def _out_rope_not_inverted():
    _patch_call(apply_rope=lambda real, x, c, s, inverse: real("apply_rope", x, c, s, False),
                apply_rope_=lambda real, x, c, s, inverse: real("apply_rope_", x, c, s, False))


def _capture_not_detached():
    import deepseek_csa.transformers.capture as dch
    dch._indexer_inputs = lambda h, qr: (h, qr)


def _ste_zero():
    # QAT roundings that pass no gradient (the input detached)
    _patch_call(fp8_round=lambda real, x, b, sc: real("fp8_round", x.detach(), b, sc),
                fp4_round=lambda real, x, b, sc: real("fp4_round", x.detach(), b, sc))


def _target_window_slots():
    import deepseek_csa.transformers.attention as A
    import deepseek_csa.transformers.capture as dch
    real = dch._capture_target

    def f(st, m, rec, q, kvbuf, idx, pos, off, T):
        real(st, m, rec, q, kvbuf, idx, pos, off, T)
        K = rec.topk_idxs.shape[-1]
        w = A._call("sparse_attn_weights", q.detach(), kvbuf.detach(),
                      m.sinks.detach().float(), idx, float(m.scaling))
        rec.attn_target = w[..., :K].contiguous()
    dch._capture_target = f


def _capture_pad_queries_kept():
    # the capture records a padded batch's pad queries as if they were real
    import deepseek_csa.transformers.capture as dch
    for name in ("_indexer_capture", "_capture_target"):
        real = getattr(dch, name)

        def f(st, *a, _real=real):
            pad, st.pad_mask = st.pad_mask, None
            try:
                return _real(st, *a)
            finally:
                st.pad_mask = pad
        setattr(dch, name, f)


def _capture_positions_dropped():
    # per-query positions not recorded: the loss takes start_pos 0 for every row
    import deepseek_csa.transformers.capture as dch
    real = dch._indexer_capture

    def f(*a):
        sel, rec = real(*a)
        if rec is not None:
            rec.positions = None
        return sel, rec
    dch._indexer_capture = f


PADDED = ["tests/test_grad_transformers.py::test_capture_padded_batch_rows_equal_rows_alone"]

MUTANTS = [
    dict(name="capture_pad_queries_kept", kind="py", targets=PADDED,
         apply=_capture_pad_queries_kept,
         what="a padded batch's pad queries take part in the captured KL loss"),
    dict(name="capture_positions_dropped", kind="py", targets=PADDED,
         apply=_capture_positions_dropped,
         what="the capture records no per-query positions for a left-padded batch"),
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
