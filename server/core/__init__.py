"""The shared core: the words the web app and the worker both use (series vocabulary,
records, run config, task names, alerts, text safety, settings, errors, the task queue).

It imports nothing of ours outside itself (import-linter: see pyproject.toml).
"""
