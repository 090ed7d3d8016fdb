"""The OpenAI-compatible HTTP server. Never imports torch: the engine arrives as an object (by default running in a
process of its own, whose main is engine_process.py)."""
