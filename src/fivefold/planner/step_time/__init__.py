"""Step time: compute and communication per layer, per chunk and per rank, in seconds."""
