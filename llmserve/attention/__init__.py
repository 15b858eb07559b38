"""Attention backends: each builds its own per-step metadata and attends over the paged KV cache. Platforms choose
one (platforms/*.py); layers/attention.py only stores K/V and hands the queries to the step's groups."""

from llmserve.attention.backend import AttentionBackend, AttentionMetadata, SeqSpan

__all__ = ["AttentionBackend", "AttentionMetadata", "SeqSpan"]
