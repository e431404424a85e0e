"""The .tg text language."""
