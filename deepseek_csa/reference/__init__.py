"""Torch references of the kernels, importable from an installed package.

One module per kernel family, written from docs/kernels.md in plain torch (float32
unless a function says otherwise): ``pool`` (gated pooling and the released
Compressor with its state), ``attn`` (sparse attention with a sink), ``index``
(indexer scores, top-k, candidate blocks, window / HCA index lists), ``norm_rope``
(RMSNorm, RoPE / YaRN tables and rotation), ``quant`` (FP8 / FP4 QAT rounding,
Hadamard), ``layer`` (whole V4 / V4.1 attention layers shaped like the released
model.py, for the swap and CSALayer tests).  The tests hold every kernel to them, the benchmarks time them as the
eager baseline.  They need torch (``pip install deepseek_csa[test]``); importing
``deepseek_csa`` itself never imports them.
"""
