"""Exercises that learners write themselves, one module per exercise, each with its own check."""
