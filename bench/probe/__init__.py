"""Probes the lead runs for the closing note: each module has `run() -> list[str]`."""
