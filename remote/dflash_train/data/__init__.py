"""Training data: jsonl to token ids to micro-batches, the token store, the tiny CPU target and its data."""
