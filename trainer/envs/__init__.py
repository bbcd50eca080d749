"""Tool-selection environments."""
