"""What every service runs on, whichever it is: the gRPC server with health and drain, settings
and flags, TLS, logs, traces and metrics, the interceptors, the parent watch."""
