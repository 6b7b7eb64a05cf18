"""Byte units shared by every layer (pure Python, imports nothing)."""

MiB = 2**20
GiB = 2**30
