"""The engine: the step loop (`core`), output processing (`output`), loading, and the offline `LLM` API."""
