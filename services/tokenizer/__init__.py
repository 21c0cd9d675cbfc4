"""Tokenizer: tokenize, chat templates, incremental detokenization."""
