"""User-facing errors. Each message says what was wrong, the value, and what is allowed."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class for errors a user can act on (bad model reference, bad checkpoint, bad request)."""


class ConfigError(TokenmillError, ValueError):
    """A model's config.json cannot be understood."""


class ModelLoadError(TokenmillError):
    """A model reference, weight file or tensor is missing, corrupt or mismatched."""


class LoraError(TokenmillError, ValueError):
    """A LoRA adapter request that cannot be carried out; `status` is the HTTP status a server answers with (400:
    a bad adapter or a name taken, 404: no adapter of that name, 409: in use by running requests)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status

    def __reduce__(self) -> tuple[type[LoraError], tuple[str, int]]:  # (sent between processes with its status)
        return type(self), (str(self), self.status)
