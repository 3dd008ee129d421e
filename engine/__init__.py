"""Colibri engine: model format, converter, C forward pass, tokenizer and sampler.

The server (app/) uses only what this module exports.
"""
