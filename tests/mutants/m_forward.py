"""Planted bugs in the forward kernels' tuned bodies (`#ifdef CSA_MUTANT_*`; the
backward kernels' are in m_grad_*.py).  Each is run against the C driver's cases of
its kernel (tuned body against the scalar `_ref` oracle) and the Python test file of
the kernel (against the torch / NumPy references).  Format: run.py."""

DRV = "tests/c/driver.c::"


def c(name, define, kernels, files, what):
    return dict(name=name, kind="c", define=define,
                targets=[DRV + k for k in kernels] + files, what=what)


MUTANTS = [
    c("attn_out", "CSA_MUTANT_ATTN_OUT", ["sparse_attn"],
      ["tests/test_attn.py", "tests/test_layer.py::test_v4_layer_matches_reference[128-260-4]"],
      "sparse_attn's output off by a relative 1e-4"),
    c("attn_sink", "CSA_MUTANT_ATTN_SINK", ["sparse_attn"], ["tests/test_attn.py"],
      "sparse_attn ignores the attention sink"),
    c("norm_mean", "CSA_MUTANT_NORM_MEAN", ["rms_norm"], ["tests/test_norm_rope.py"],
      "rms_norm (float32) averages the squares over d + 1"),
    c("rope_inverse", "CSA_MUTANT_ROPE_INVERSE", ["apply_rope"], ["tests/test_norm_rope.py"],
      "apply_rope's inverse rotates forward"),
    c("pool_group", "CSA_MUTANT_POOL_GROUP", ["gated_pool", "pool_stream"], ["tests/test_pool.py"],
      "gated_pool off by one: each group's last token left out"),
    c("pool_qat_hadamard", "CSA_MUTANT_POOL_QAT_HADAMARD", ["pool_stream"], ["tests/test_pool.py"],
      "the pooling epilogue's QAT step drops the Hadamard before FP4 (tuned levels)"),
    c("quant_skip", "CSA_MUTANT_QUANT_SKIP", ["quant_round"], ["tests/test_quant.py"],
      "quant_round (float32) leaves each row's last block unrounded"),
    c("hadamard_scale", "CSA_MUTANT_HADAMARD_SCALE", ["hadamard"], ["tests/test_quant.py"],
      "hadamard (float32) scale off by a relative 1e-4"),
    c("sinkhorn_iters", "CSA_MUTANT_SINKHORN_ITERS", [], ["tests/test_gemm.py"],
      "hc_split_sinkhorn runs one iteration fewer"),
    c("gemm_scale", "CSA_MUTANT_GEMM_SCALE", ["gemm"], ["tests/test_gemm.py"],
      "fp8/fp4 gemm: the last K block uses the previous block's activation scale"),
    c("gemm_vnni_order", "CSA_MUTANT_GEMM_VNNI_ORDER", [], ["tests/test_gemm.py"],
      "fp4_gemm one row (int8 path, AVX-512 VNNI + VBMI): dot-product lanes hold four of the oracle's lanes each"),
    c("gemm_vnni_pass", "CSA_MUTANT_GEMM_VNNI_PASS", [], ["tests/test_gemm.py"],
      "fp4_gemm one row (int8 path): activation columns with s = 5..7 or 13..14 wrap their pass byte"),
    c("gemm_i8_pass3", "CSA_MUTANT_GEMM_I8_PASS3", [], ["tests/test_gemm.py"],
      "fp4_gemm one row (AVX2 int8 path): a chunk's third byte pass (its lowest bits) left out"),
    c("gemm_i8_sign", "CSA_MUTANT_GEMM_I8_SIGN", [], ["tests/test_gemm.py"],
      "fp4_gemm one row (AVX2 int8 path): the high-nibble columns' activation signs dropped"),
    c("gemm_i8_scale", "CSA_MUTANT_GEMM_I8_SCALE", [], ["tests/test_gemm.py"],
      "fp4_gemm one row (AVX2 int8 path): an e8m0 scale 0xff (NaN) decoded by the plain shift (inf)"),
    c("gemm_dp_order", "CSA_MUTANT_GEMM_DP_ORDER", [], ["tests/test_gemm.py"],
      "fp8_gemm one row (AVX512_BF16 dot products): each pair of the oracle's steps added in the wrong order"),
    c("gemm_amx_fold", "CSA_MUTANT_GEMM_AMX_FOLD", [], ["tests/test_gemm.py"],
      "fp4_gemm bf16 GEMM (tiles or AVX512_BF16): the last K block's weight scales folded as 1"),
    c("gemm_amx_fp8", "CSA_MUTANT_GEMM_AMX_FP8", [], ["tests/test_gemm.py"],
      "fp8_gemm bf16 GEMM (tiles or AVX512_BF16): each K block folds the previous block's weight scale"),
    c("gemm_dp_last", "CSA_MUTANT_GEMM_DP_LAST", [], ["tests/test_gemm.py"],
      "fp8/fp4 gemm, AVX512_BF16 dot products (avx512 level, no AMX): the last 32 columns of K left out"),
    c("gemm_batch", "CSA_MUTANT_GEMM_BATCH", ["gemm_batch"], ["tests/test_gemm.py"],
      "fp8/fp4 gemm, several one-row problems in one region (b_index): each takes the first one's activation scales"),
    c("gemm_index_step", "CSA_MUTANT_GEMM_INDEX_STEP", [], ["tests/test_gemm.py"],
      "fp8/fp4 gemm b_index: a run of evenly spaced rows writes its outputs to adjacent rows"),
    c("topk_slot", "CSA_MUTANT_TOPK_SLOT", ["index_topk"], ["tests/test_index.py"],
      "index_topk loses each row's last slot"),
    c("index_scores", "CSA_MUTANT_INDEX_SCORES", ["index_scores"], ["tests/test_index.py"],
      "index_scores off by a relative 1e-4"),
    c("fp4_index_fuse", "CSA_MUTANT_FP4_INDEX_FUSE", ["index_scores fp4"], ["tests/test_fp4_index.py"],
      "FP4 index_topk (integer path): relu(dot) * w fused into the head sum, one rounding instead of the oracle's two"),
    c("fp4_index_spread", "CSA_MUTANT_FP4_INDEX_SPREAD", [], ["tests/test_fp4_index.py"],
      "FP4 index_topk (integer path): keys whose blocks spread by 2^4 (2^3 without VNNI) prescaled, their bytes wrap"),
    c("fp4_index_amx", "CSA_MUTANT_FP4_INDEX_AMX", [], ["tests/test_fp4_index.py"],
      "FP4 index_topk (AMX-INT8 tiles): the head scales folded into weights that w 2^(eq - 129) rounds"),
    c("fp4_index_int16", "CSA_MUTANT_FP4_INDEX_INT16", [], ["tests/test_fp4_index.py::test_int16_lanes_at_their_bound"],
      "FP4 index_topk (VPMADDUBSW path): int16 lane sums taken up to 2^16, past 2^15 they wrap"),
    c("fp4_index_factor", "CSA_MUTANT_FP4_INDEX_FACTOR", [],
      ["tests/test_fp4_index.py::test_factored_head_sum_at_its_range_bounds"],
      "FP4 index_topk (VNNI path): the head sum factored without its lower bound, terms the oracle rounds below the normals"),
    # the driver's random codes rarely tell head orders apart; the test's cancelling
    # heads do
    c("fp4_index_cascade", "CSA_MUTANT_FP4_INDEX_CASCADE", [],
      ["tests/test_index_bf16_rounding.py"],
      "FP4 index_scores(rounding='bf16'): heads summed one by one, not in torch's 16-head cascade"),
    c("fp4_topk_pos", "CSA_MUTANT_FP4_TOPK_POS", [], ["tests/test_fp4_index.py"],
      "FP4 index_topk (fused top-k, AVX-512 keep loop): kept keys' positions counted from the chunk's start"),
]
