"""Probes the lead runs for issue notes: each module has `run() -> list[str]`."""
