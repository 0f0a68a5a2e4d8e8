"""The torch reference lives in the package (deepseek_csa.reference.pool); the tests
import it under this short name, as the very same module object."""
import sys

from deepseek_csa.reference import pool as _m

sys.modules[__name__] = _m
