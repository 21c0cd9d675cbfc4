"""The simulated backend: real KV accounting and sampling contract, no model computed."""
