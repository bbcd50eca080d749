"""Rollout Lens trainer: the Escalation env, the tiny model and the recording GRPO trainer."""
