"""Rollout Lens: the web app, the store and the CLI (no torch, transformers or trl here)."""
