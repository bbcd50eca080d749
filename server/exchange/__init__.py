"""Runs in and out of files: our own export and import (schema), TRL's and verl's
dump files, and following a folder while its trainer writes it.
"""
