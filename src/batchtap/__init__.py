"""batchtap: per-batch training metrics for PyTorch, captured with zero host syncs."""
