"""quantize: the released checkpoint's FP8 / FP4 projections back on their codes."""
from __future__ import annotations

import warnings
from typing import Iterable, Optional

from .swap import _base
from .versions import _torch

# ----------------------------------------------------------------------------- FP8 / FP4 weights
# The projections the released checkpoint stores as FP8 (e4m3, ue8m0 128 x 128 blocks),
# by transformers' module names; the routed experts are its FP4 ones.  The compressors
# (float32 in the release), the indexer's weights_proj, the router, the embedding and the
# head keep their weights.
_FP8_ATTN = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj")
_FP8_MLP = ("gate_proj", "up_proj", "down_proj")


def quantize(model, layers: Optional[Iterable[int]] = None, *,
             own_memory: bool = True) -> dict:
    """Holds the chosen decoder layers' (None: all) projections as the released checkpoint
    holds them and computes them as the released model.py does: attention projections
    (``q_a_proj``, ``q_b_proj``, ``kv_proj``, the grouped ``o_a_proj``, ``o_b_proj``), the
    indexer's ``q_b_proj`` and the shared expert become ``deepseek_csa.torch.FP8Linear``,
    the routed experts ``FP4Experts`` (docs/layers.md, "FP8 / FP4 weights").  For
    inference (``torch.no_grad()``); independent of ``swap`` (either order), one-way (the
    float weights are dropped: that is the memory it saves).

    Exact for a model loaded from a released FP8 / FP4 checkpoint (transformers
    dequantizes it; the codes come back bit for bit); other float weights are rounded to
    FP8 / FP4, with one warning naming how many modules were.  The outputs differ from
    transformers' own by the activation's e4m3 rounding in front of each projection (the
    released Linear's).

    ``own_memory`` (default): afterwards every parameter and buffer left in float is
    copied into memory of its own.  transformers memory-maps the checkpoint and its
    parameters are views of that file: the map, and every page of it the quantization
    read, stayed resident while any view was alive (3.2 GB RSS on the 3-layer bench
    model; 1.1 GB after the copies).  Returns ``{"fp8": [module names], "fp4": [...],
    "rounded": [...], "bytes_before": n, "bytes_after": n}`` (the weights' bytes)."""
    from ..torch.quantized import FP4Experts, FP8Linear
    base = _base(model)
    if not hasattr(base, "layers"):
        raise TypeError("quantize() takes a DeepseekV4ForCausalLM or DeepseekV4Model, got "
                        f"{type(model).__name__}")
    n = len(base.layers)
    chosen = list(range(n)) if layers is None else sorted({int(i) for i in layers})
    for i in chosen:
        if not 0 <= i < n:
            raise ValueError(f"quantize(): layer {i} out of range (the model has {n} layers)")
    report = dict(fp8=[], fp4=[], rounded=[], bytes_before=0, bytes_after=0)

    def nbytes(mod):
        return sum(t.numel() * t.element_size() for t in
                   list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False)))

    # every replacement is built before any is made: a module that cannot be held as
    # FP8 / FP4 (a shape off the 128 blocks, a non-finite weight) raises with the model
    # untouched
    plan = []
    for i in chosen:
        layer, p = base.layers[i], f"layers.{i}."
        attn = layer.self_attn
        owners = [(attn, a, p + "self_attn." + a, "fp8") for a in _FP8_ATTN]
        indexer = getattr(getattr(attn, "compressor", None), "indexer", None)
        if indexer is not None:
            owners.append((indexer, "q_b_proj", p + "self_attn.compressor.indexer.q_b_proj",
                           "fp8"))
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            owners += [(shared, a, p + "mlp.shared_experts." + a, "fp8") for a in _FP8_MLP]
        if hasattr(layer.mlp, "experts"):
            owners.append((layer.mlp, "experts", p + "mlp.experts", "fp4"))
        for owner, attr, name, kind in owners:
            old = getattr(owner, attr)
            if isinstance(old, (FP8Linear, FP4Experts)):
                continue
            try:
                new = (FP4Experts.from_experts(old) if kind == "fp4" else
                       FP8Linear.from_linear(old, groups=getattr(old, "n_groups", 1)))
            except ValueError as e:
                raise ValueError(f"quantize(): {name}: {e}") from None
            plan.append((owner, attr, old, new, name, kind))
    for owner, attr, old, new, name, kind in plan:
        report["bytes_before"] += nbytes(old)
        report["bytes_after"] += nbytes(new)
        setattr(owner, attr, new)
        report[kind].append(name)
        if not new.exact:
            report["rounded"].append(name)
    plan.clear()
    if own_memory:
        torch = _torch()
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()
            for mod in model.modules():
                for key, b in list(mod._buffers.items()):
                    if b is not None:
                        mod._buffers[key] = b.clone()
    if report["rounded"]:
        warnings.warn(f"quantize(): {len(report['rounded'])} modules' weights were not FP8 / "
                      f"FP4 values and were rounded (first: {report['rounded'][0]}); the "
                      "model's outputs change by more than the activation rounding",
                      stacklevel=2)
    return report
