"""fivefold.spec"""
