"""Executors: the C core (CPU) behind one Model interface."""
