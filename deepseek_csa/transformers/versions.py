"""Which transformers releases the bridge accepts, and the attribute names that changed
between them (the version checks and the reads they guard)."""
from __future__ import annotations

# The transformers releases whose DeepseekV4 modeling code the bridge is tested against
# (`make test-hf-versions` runs the bridge tests on each, in its own environment).  A
# release in the same major.minor series as one of these (a patch release) is accepted
# too.  The next release: add it here and to pyproject's range, run the target.
SUPPORTED_VERSIONS = ("5.23.0", "5.24.0", "5.25.0")


def _torch():
    import torch
    return torch


def _supported(v):
    """True for a tested release or a final patch release of a tested major.minor."""
    if v in SUPPORTED_VERSIONS:
        return True
    parts = v.split(".")
    return (len(parts) == 3 and parts[2].isdigit() and
            any(parts[:2] == x.split(".")[:2] for x in SUPPORTED_VERSIONS))


def _check_version():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover
        raise ImportError("deepseek_csa.transformers needs transformers "
                          f"{' or '.join(SUPPORTED_VERSIONS)} (pip install "
                          "'deepseek_csa[hf]')") from e
    v = transformers.__version__
    if not _supported(v):
        series = ", ".join(".".join(x.split(".")[:2]) + ".x" for x in SUPPORTED_VERSIONS)
        raise RuntimeError(f"deepseek_csa.transformers supports transformers {series} "
                           f"(tested: {', '.join(SUPPORTED_VERSIONS)}; its DeepseekV4 modeling "
                           f"code changes between releases), found {v}; install "
                           f"transformers=={SUPPORTED_VERSIONS[-1]}")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mdl
    return mdl


def _norm_eps(norm):
    """The epsilon of an RMSNorm module: transformers 5.25 renamed the unweighted norm's
    ``eps`` (``q_b_norm``, the hyper-connections' ``input_norm``) ``variance_epsilon``,
    the weighted norms' name."""
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps
