"""Tensor parallelism: how a model is split across ranks (layout), the collectives
between them (group), and the Ray worker actors that run the extra ranks (workers)."""
