"""Memory per GPU, per pipeline rank: parameters, gradients, optimizer state, activations."""
