"""Measured hardware and quality profiles shipped with skistune (package data: the JSON files here)."""
