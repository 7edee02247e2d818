"""Runnable examples for ferrocore; `examples.models` holds the models the tests and benchmark share."""
