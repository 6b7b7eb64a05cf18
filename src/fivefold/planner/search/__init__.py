"""The layout search: candidates, bounds, the search state, outcomes, partial layouts completed."""
