"""Scoring answers: built-in rewards and verifiers, the code sandbox, reward models, user
functions in a worker pool, and TRL's reward functions."""
