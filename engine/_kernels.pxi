# kernels binding: owned by the kernels work (see docs/INTERNALS.md)
