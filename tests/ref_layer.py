"""The torch reference layer lives in the package (deepseek_csa.reference.layer); the
tests import it under this short name, as the very same module object."""
import sys

from deepseek_csa.reference import layer as _m

sys.modules[__name__] = _m
