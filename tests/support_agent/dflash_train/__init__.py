"""Stand-in for the trainer package in the agent's tests (see __main__.py)."""
