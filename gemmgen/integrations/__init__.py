"""PyTorch integration: custom ops (torch.library) and drop-in modules."""
