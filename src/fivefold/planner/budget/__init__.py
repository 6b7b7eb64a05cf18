"""What the budget holder asks: time, cost, failures of a token budget; how far to trust a plan."""
