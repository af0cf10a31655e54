"""Test support for the agent: a temporary workspace with a release holding the real
agent and a scripted stand-in trainer (dflash_train/), and helpers to drive it."""
