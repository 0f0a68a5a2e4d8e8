"""The torch reference lives in the package (deepseek_csa.reference.norm_rope); the tests
import it under this short name, as the very same module object."""
import sys

from deepseek_csa.reference import norm_rope as _m

sys.modules[__name__] = _m
