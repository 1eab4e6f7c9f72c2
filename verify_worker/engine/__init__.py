"""The speculative engine (core.py) and its parts."""

from verify_worker.engine.core import SpeculativeEngine

__all__ = ["SpeculativeEngine"]
