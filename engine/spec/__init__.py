"""Speculative decoding: drafting tokens that the step engine verifies in one forward pass."""

# off: one token per sequence and step; ngram: prompt lookup (engine.spec.ngram), always
# num_speculative_tokens drafts; auto: prompt lookup with k per sequence and step chosen by the
# cost model (engine.spec.cost), 0 where drafts do not pay; mtp: the model's own
# multi-token-prediction layer (engine.spec.mtp)
SPECULATIVE_METHODS = ("off", "auto", "ngram", "mtp")

# drafts per sequence and step at most when num_speculative_tokens is not set: auto's draft cap
# grows with the match (engine.spec.cost.draft_cap), the others draft this many every step
DEFAULT_NUM_TOKENS = {"auto": 16}
DEFAULT_NUM_TOKENS_OTHERS = 4


def default_num_tokens(method: str) -> int:
    """num_speculative_tokens when it is not set, for method."""
    return DEFAULT_NUM_TOKENS.get(method, DEFAULT_NUM_TOKENS_OTHERS)
