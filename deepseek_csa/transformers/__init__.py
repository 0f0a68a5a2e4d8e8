"""Hugging Face transformers bridge: run ``DeepseekV4Attention`` layers of a
``DeepseekV4ForCausalLM`` / ``DeepseekV4Model`` (transformers 5.23 - 5.25) through deepseek_csa.

    import deepseek_csa.transformers as dch
    with torch.no_grad(), dch.swapped(model):          # every attention layer
        out = model.generate(ids, max_new_tokens=64)
    dch.swap(model, layers=[1, 3]); ...; dch.unswap(model)

torch and transformers are imported lazily; only the transformers releases in
``SUPPORTED_VERSIONS`` (5.23.0, 5.24.0, 5.25.0) and patch releases of their series are
accepted, other versions raise ``RuntimeError`` naming both (the modeling code of this
young model still changes between releases, and equivalence is only tested there; ``make
test-hf-versions`` runs the bridge tests under each).  5.24 names the cache argument
``cache`` (``past_key_values`` is its deprecated alias): both are accepted.  5.25 renames
the unweighted norms' ``eps`` ``variance_epsilon`` (read whichever the module has) and
opens assisted decoding to models whose cache can be cropped (below).

How a layer is swapped: the chosen ``DeepseekV4Attention`` modules get an instance
``forward`` with the module's signature that keeps the module's own projections
(``q_a_proj``, ``q_b_proj``, ``kv_proj``, the compressor's and indexer's projections,
``o_a_proj`` / ``o_b_proj``: quantized or bf16 weights keep working) and runs the
RMSNorms, RoPE, the compressor's gated pooling, the indexer's scoring and top-k, the index
lists and the sparse attention through our kernels.  The attention gathers the window
rows and the selected compressed entries (``sparse_attn``) instead of attending every
entry under a dense -inf mask, and the indexer never materializes its [B, S, T] scores
(``index_topk``).  When every attention layer is swapped the model's dense
[B, 1, S, L+T] mask is not built at all (the model gets a mask dict holding ``None``).
The swapped layers' hyper-connections (``attn_hc`` / ``ffn_hc``) split their mixes with
``hc_split_sinkhorn`` (one C call for the pre / post weights and the Sinkhorn comb).

``quantize(model)`` (independent of the swap) puts the projections the released
checkpoint stores as FP8 back on FP8 codes and the routed experts on FP4 codes
(``deepseek_csa.torch.FP8Linear`` / ``FP4Experts``), computed as the released model.py's
Linear computes them (activations rounded to e4m3 per 128 in front of each GEMM): 2.8x
less weight memory, and decode reads 2-4x fewer bytes (docs/layers.md, "FP8 / FP4
weights").

State lives where transformers keeps it: window rows in the model's cache layer
(``DynamicSlidingWindowLayer`` or the CSA/HCA layer's own window), the compressor's
buffers, overlap rows and compressed entries in the same fields of the CSA/HCA cache
layers, whose class is switched on first use to our subclasses ``CSACacheLayer`` /
``HCACacheLayer`` (same fields, so a layer can be unswapped mid-generation and
transformers' own forward continues from our state, and vice versa).  Ours add ``crop``
(after ``activate_past_recording()``, as for transformers' sliding layers) and keep
``reset`` / ``reorder_cache`` (beam search) working.  Chunked prefill (a multi-token
call at ``start_pos > 0``) and ``generate()`` from ``past_key_values`` work.

Assisted decoding (``generate(assistant_model=...)``, prompt lookup): 5.23 / 5.24 refuse
it for the model class.  5.25 runs it when every layer of the main model's cache can be
cropped (``is_croppable``: ours can, transformers' own CSA/HCA layers cannot), so with
every compressed layer swapped it gives greedy decoding's tokens, and with one unswapped
transformers refuses after the prefill.  transformers crops an assistant's cache
unchecked, so a swapped model's ``generate`` refuses (``ValueError``) a DeepseekV4
assistant whose compressed layers are not swapped too (docs/transformers.md).

Semantics are transformers' (not DeepSeek's model.py): no QAT (``qat=True`` adds
model.py's FP8 rounding of the KV rows and compressed entries in front of the rope tail
and the Hadamard + FP4 rounding of indexer queries and keys); RoPE on the trailing
``rope_head_dim`` features with interleaved pairs and the model's own cos/sin tables
(YaRN and its attention factor included); compressed entry ``g`` at position
``g * ratio``; the sink as an extra logit.  Top-k ties are broken deterministically
(equal scores: the lower position wins), which ``torch.topk`` does not promise (its
order depends on the call shape, so transformers' own prefill and decode can disagree);
up to such ties the selection is transformers'.

Covered: float32 and bfloat16 CPU models, batch >= 1, padded batches (a 2-D attention
mask with left or right padding) and position ids that differ per row, prefill, chunked
prefill, decode, greedy / sampling / beam search through ``generate()``, sliding, CSA
and HCA layers, any subset of layers, and training: inference and training are one path,
every kernel a ``torch.ops.deepseek_csa`` operator (``rms_norm``, ``apply_rope``,
``gated_pool``, ``index_topk``, ``sparse_attn``, ...) called through
``deepseek_csa.torch.ops.call``, so with autograd recording ``loss.backward()`` runs on
our backward kernels (QAT roundings straight-through; the indexer's selection discrete,
no gradient), padded batches and per-row positions train as they infer, and a swapped
model compiles (``torch.compile``, no graph break of ours, ``fullgraph=True`` for a
layer) and exports (``torch.export``, non-strict; docs/transformers.md).
``capture_indexer(model)`` hands back, per CSA layer, the indexer's q / k / weights (from
inputs detached from the main graph), its selection and the attention target, for ``deepseek_csa.torch.indexer_kl_loss`` (docs/layers.md, "Training through
the transformers swap").

Padded batches reproduce transformers' eager semantics (docs/transformers.md): pad tokens
are masked out as keys of the sliding window only; the compressors pool them into the
compressed entries like any token (windows of ``ratio`` tokens by index, entry ``g`` at
RoPE position ``g * ratio``); a query sees the entries ``t < (position + 1) // ratio``
of its own position id (HCA decode steps see every entry, as in eager); RoPE of queries,
KV rows and indexer queries uses each row's positions.  The 2-D mask goes to the layers
as it is (never the dense [B, 1, S, L+T] mask when every layer is swapped).

Falls back to transformers' own forward (one warning per reason, never silently wrong):
a prebuilt 4-D / dict mask, a 2-D mask whose length is not cached + new tokens, position
ids not of shape [B or 1, S], attention dropout in training mode, autograd with a build
lacking the differentiable ops, ``output_attentions``, tensors not on the CPU or not
float32 / bfloat16.  ``capture_indexer`` records padded batches and per-row positions
(each query's position; pad queries take no part).

bfloat16: the kernels read bf16 activations in place and compute in float32 with one
rounding per op (norms, RoPE, pooled entries, attention output).  transformers' bf16 path
rounds more often (the RoPE cos/sin tables -- which we take from the model, so that one
is shared -- the softmax weights of the pooling and the pooled sums, the unweighted
query norm's scale), so swapped bf16 logits differ from transformers' bf16 by bf16
rounding noise and are typically closer to a float32 run.
"""
from __future__ import annotations

# The bridge's modules: versions (which transformers releases, renamed attributes), cache
# (our CSA / HCA cache layers), attention (a swapped layer: one path for inference,
# training, compile and export), capture (capture_indexer), swap (swap / unswap, the
# model wrapper), quantize (FP8 / FP4 weights).  torch and transformers stay lazy.
from .versions import SUPPORTED_VERSIONS, _check_version, _supported  # noqa: F401

# Training memory: autograd would keep four [B, S, H, D] tensors per swapped layer (the
# query projection for the norm's backward, the rotated query and the attention output
# for sparse_attn's, the de-rotated output for o_a_proj's); with this on, the per-head
# norm -> RoPE -> sparse_attn -> inverse RoPE segment is recomputed in the backward
# (torch.utils.checkpoint), so two are kept.  The recompute costs one sparse-attention
# forward, small next to the layer's projections.  Read at every call.
CHECKPOINT_ATTENTION = True

from .cache import _cache_classes  # noqa: E402,F401
from .attention import _missing_grad_ops  # noqa: E402,F401
from .capture import IndexerCapture, IndexerRecord, capture_indexer  # noqa: E402
from .swap import is_swapped, swap, swapped, unswap  # noqa: E402
from .quantize import quantize  # noqa: E402

__all__ = ["SUPPORTED_VERSIONS", "swap", "unswap", "swapped", "is_swapped", "quantize",
           "capture_indexer", "IndexerCapture", "IndexerRecord",
           "CSACacheLayer", "HCACacheLayer"]


def __getattr__(name):
    if name == "CSACacheLayer":
        return _cache_classes()[1]
    if name == "HCACacheLayer":
        return _cache_classes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
