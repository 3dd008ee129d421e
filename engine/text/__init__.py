"""Text: tokenizer, chat templates, incremental detokenizer, stop strings."""
