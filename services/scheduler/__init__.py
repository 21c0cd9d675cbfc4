"""Scheduler: queues, token-budget continuous batching, paged KV blocks. Pure Python, no tensors."""
