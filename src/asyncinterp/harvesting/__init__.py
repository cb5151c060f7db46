"""Harvest: activations over a whole dataset, to disk, and reductions of them (docs/harvest.md)."""
