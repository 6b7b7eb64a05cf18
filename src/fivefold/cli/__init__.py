"""fivefold.cli"""
