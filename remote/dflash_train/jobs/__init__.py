"""The jobs the trainer runs (train, regenerate, evaluate), their start-up and what they share."""
