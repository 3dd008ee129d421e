"""Speculative decoding: drafting tokens that the step engine verifies in one forward pass."""

# off: one token per sequence and step; ngram: prompt lookup (engine.spec.ngram), always
# num_speculative_tokens drafts; auto: prompt lookup with k per sequence and step chosen by the
# cost model (engine.spec.cost), 0 where drafts do not pay; mtp: the model's own
# multi-token-prediction layer (engine.spec.mtp)
SPECULATIVE_METHODS = ("off", "auto", "ngram", "mtp")
