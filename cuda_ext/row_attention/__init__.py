"""The target's causal attention, each row in an order its own positions fix (see rows.h)."""
