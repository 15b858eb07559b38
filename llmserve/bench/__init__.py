"""`llmserve bench`: load generation and serving metrics against any OpenAI-compatible server."""
