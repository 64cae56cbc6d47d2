"""PyTorch integration: each recipe as a torch.library op (`ops`), with what differs between dense
and grouped recipes in `dense` and `grouped`. The modules built on it are `gemmgen.nn`."""
