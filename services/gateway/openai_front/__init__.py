"""The OpenAI-compatible HTTP front: request bodies in, OpenAI responses out, on the same
handler as a gRPC call."""
