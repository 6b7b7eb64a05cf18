"""Byte units shared by every layer (pure Python, imports nothing)."""

KiB = 2**10
MiB = 2**20
GiB = 2**30
