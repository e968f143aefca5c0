"""Assembly of a rank's run: process groups, the compute backend, the model chunks, the optimizer."""
