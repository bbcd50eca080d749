"""The worker: the Celery task, one run end to end, and the model a run names."""
