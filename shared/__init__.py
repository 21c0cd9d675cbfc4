"""Contracts shared by the services: step plan/result, sampling, errors, config, block hashing."""
