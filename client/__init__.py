"""Clients of a running server (dflash-bench): HTTP only, no model code."""
