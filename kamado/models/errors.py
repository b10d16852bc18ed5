"""The one error the models package raises for anything a user can fix."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model could not be found, downloaded, verified or loaded; the message says what to do."""
