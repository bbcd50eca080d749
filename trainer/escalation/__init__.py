"""The Escalation task as training sees it: dataset, rewards and judge (task),
greedy evaluation, supervision, and the multi-turn variant through TRL's tool loop.
"""
