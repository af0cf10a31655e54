"""The training loop: the replicas' step, gradient exchange, optimizer step, threaded pipeline, rank 0's schedule."""
