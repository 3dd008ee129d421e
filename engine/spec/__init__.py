"""Speculative decoding: drafting tokens that the step engine verifies in one forward pass."""

# off: one token per sequence and step; ngram: prompt lookup (engine.spec.ngram); mtp: the
# model's own multi-token-prediction layer (engine.spec.mtp)
SPECULATIVE_METHODS = ("off", "ngram", "mtp")
