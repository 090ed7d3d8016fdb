"""The OpenAI-compatible HTTP server. Never imports torch: the engine arrives as an object."""
