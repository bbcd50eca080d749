"""The web app alone: the FastAPI app (app), HTTP plumbing (http), what each page
shows (pages), the routes, and the pages' SQL reads (queries).
"""
