"""Prompts and gold answers: local files and folders, and task libraries (reasoning-gym)."""
