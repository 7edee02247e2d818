"""Runnable examples for ferrocore; `examples.models` is shared with the tests and bench."""
