"""Tensor parallelism for the verify worker: sharded layers, the slice of each checkpoint tensor a rank
loads, and the leader/follower protocol that keeps every rank on the same forward."""
