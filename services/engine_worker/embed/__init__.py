"""Embeddings: the BERT-family encoder and the `Embed` service that batches inputs for it."""
