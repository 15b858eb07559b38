"""`llmserve plan`: memory, compute, transfer and cost arithmetic for serving a model on given hardware."""
