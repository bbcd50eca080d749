"""HTTP routes: HTML pages (html) and their JSON twins under /api (api), what
changes something (actions), downloads, signing in and out (signin).
"""
