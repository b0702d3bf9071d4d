"""`batchspec serve`: the OpenAI-compatible HTTP server over an engine thread."""
