"""The OpenAI-compatible HTTP API: the server, request validation, the schema, tools."""
