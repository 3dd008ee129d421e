"""Colibri's HTTP server: the OpenAI-compatible API over the engine.

Knows nothing of tensors: it sees the engine only through `colibri.engine`'s package exports
(an EngineClient), whose own thread runs the model, so the event loop never blocks.
"""
