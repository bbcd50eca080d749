"""Rollout Lens's trainer, one package per layer: worker -> escalation (the task) ->
builders -> envs -> recorder (RolloutLensCallback's side); it never imports the web app.
"""
