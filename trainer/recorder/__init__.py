"""The recorder: RolloutLensCallback and what it records with (capture, probes,
turns, the step writer).

It never imports the Escalation task, its envs, the builders or the worker, so
`from rollout_lens import RolloutLensCallback` loads none of them.
"""
