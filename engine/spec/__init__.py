"""Speculative decoding: drafting tokens that the step engine verifies in one forward pass."""

# off: one token per sequence and step; ngram: prompt lookup (engine.spec.ngram)
SPECULATIVE_METHODS = ("off", "ngram")
