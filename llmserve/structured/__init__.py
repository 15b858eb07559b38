"""Structured output: grammar compile and per-step token masks (manager.py)."""

from llmserve.structured.manager import GrammarMatcher, StructuredOutputManager

__all__ = ["GrammarMatcher", "StructuredOutputManager"]
