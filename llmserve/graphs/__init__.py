"""Graph runners: compiled forms of whole steps that the model runner takes instead of eager PyTorch where a step is
of a kind captured at start-up. inductor.py: torch.compile (CPU and CUDA)."""
