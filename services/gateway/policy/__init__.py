"""What a tenant or a request may do: the policy object, request limits, rate limits, engine-
failure limits and stalled clients."""
