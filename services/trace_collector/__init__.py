"""Trace-collector: OTLP spans from every service, per-request waterfalls and phase percentiles."""
