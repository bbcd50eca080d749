"""The words the web app and the worker share: the run config, the task's vocabulary, the presets.

Importable from either side without pulling in the other: nothing here imports FastAPI, SQL,
torch or the trainer.
"""
