"""HTTP plumbing: request dependencies, the security middleware and sign-in
limits, JSON responses and their cache, templates, errors into responses, timing.
"""
