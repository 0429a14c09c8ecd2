"""The model spec: config.json read without torch, and the KV sizing formula."""
