"""The explanation of a search result in words with numbers."""
