"""``EngineError``: the one exception of the engine layer."""

from __future__ import annotations


class EngineError(RuntimeError):
    """An engine failed to start, died, or was configured against the rules (the message names the engine)."""
