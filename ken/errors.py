"""One exception hierarchy for the whole package: every error a user can see is a KenError."""

from __future__ import annotations


class KenError(Exception):
    """Base class of every error KEN raises on purpose; the message says what to do."""


class ModelError(KenError):
    """A model could not be prepared, loaded or run."""


class DataError(KenError):
    """Input data is missing or has the wrong shape or type."""


class ProfileError(KenError):
    """A profile is missing, stale or inconsistent with what it is used for."""


class CascadeError(KenError):
    """A cascade is malformed or does not match the models/profiles given."""
