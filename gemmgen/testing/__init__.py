"""Test infrastructure shipped with gemmgen (the nvcc host oracle)."""
