"""Speculative decoding: proposers that guess the next tokens cheaply; the target verifies them exactly."""
