"""The drafter, its objective and loss, the frozen target, the export and speculative decoding."""
