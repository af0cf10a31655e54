"""Checkpoints: the folders written and loaded, the training state they hold, the writer thread."""
