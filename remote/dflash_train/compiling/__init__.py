"""Building the train step: the compile policy, torch.compile and CUDA-graph steps, the compile cache."""
