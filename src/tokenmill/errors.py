"""User-facing errors. Each message says what was wrong, the value, and what is allowed."""

from __future__ import annotations


class TokenmillError(Exception):
    """Base class for errors a user can act on (bad model reference, bad checkpoint, bad request)."""


class ConfigError(TokenmillError, ValueError):
    """A model's config.json cannot be understood."""


class ModelLoadError(TokenmillError):
    """A model reference, weight file or tensor is missing, corrupt or mismatched."""
