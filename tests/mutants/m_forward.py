"""Planted bugs in the forward kernels' tuned bodies (`#ifdef CSA_MUTANT_*`), one file
per concern elsewhere (m_grad_*.py for the backward kernels).  Format: run.py."""

MUTANTS = [
    dict(name="attn_out", kind="c", define="CSA_MUTANT_ATTN_OUT",
         targets=["tests/c/driver.c::sparse_attn", "tests/test_attn.py"],
         what="sparse_attn's output off by a relative 1e-4 (tuned body)"),
    dict(name="attn_sink", kind="c", define="CSA_MUTANT_ATTN_SINK",
         targets=["tests/c/driver.c::sparse_attn", "tests/test_attn.py"],
         what="sparse_attn ignores the attention sink (tuned body)"),
]
