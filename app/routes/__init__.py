"""HTTP routes, one module per endpoint family (as vLLM lays them out)."""
