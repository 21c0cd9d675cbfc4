"""Model artifacts: finding, validating and reading a GGUF file or an HF checkpoint into
`ModelWeights`, with the architecture and rotary settings they declare."""
