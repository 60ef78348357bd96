"""lmdx's native core compiled for x86-64-v4; see :mod:`lmdx._core`.

Importing this module checks that the CPU runs x86-64-v4 (raising ImportError when it does
not) and only then opens the compiled ``lmdx/_native/_core_avx512``, which replaces this
module in ``sys.modules``.
"""

import sys

from lmdx._core import load_native

sys.modules[__name__] = load_native("avx512")
