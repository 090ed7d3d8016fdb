"""The engine: the step loop (`core`), output processing (`output`), the async facade and the offline `LLM` API."""
