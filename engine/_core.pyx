# cython: language_level=3
"""colibri.engine._core: the Cython binding of the C core (csrc/).

One include per C area so each grows on its own; Python code uses engine's modules, not this.
"""

include "_kernels.pxi"
include "_model.pxi"
include "_bench.pxi"
include "_linear.pxi"
