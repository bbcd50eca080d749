"""HTTP routes: HTML pages (pages) and their JSON twins under /api (api)."""
