"""Checkpoints in PyTorch's distributed checkpoint (DCP) format, committed atomically."""
