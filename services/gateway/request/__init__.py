"""One request's life: admission (checks, sampling, tokenize, route), placement, the prefill/decode
split, the relay of its events (text, stop strings, tool calls, output check), its record,
telemetry and metrics."""
