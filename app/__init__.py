"""Colibri's HTTP server: the OpenAI-compatible API over the engine.

Knows nothing of tensors: it sees the engine only through `engine`'s package exports, and
runs every engine call on one engine thread (app.worker) so the event loop never blocks.
"""
