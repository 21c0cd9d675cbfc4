"""Gateway: the public gRPC API and the OpenAI HTTP front; auth, admission, routing."""
