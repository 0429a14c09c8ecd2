"""The step loop and what it schedules: requests, the KV page pool, prefix cache, output ring."""
