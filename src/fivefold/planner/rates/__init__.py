"""Device rates: how fast a GPU or a measured device computes, streams memory and communicates."""
