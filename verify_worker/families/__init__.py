"""Target families: one folder per model family (its config, its layers, its loading table), the interface the
engine relies on (interface.py) and the registry from a checkpoint's "architectures" (registry.py)."""
