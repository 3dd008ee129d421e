"""Sampling: parameters, the per-sequence sampler and the batched sampler of a step."""
