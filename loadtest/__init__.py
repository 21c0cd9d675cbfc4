"""Benchmarks and load generators; none of this runs in the default test suite."""
