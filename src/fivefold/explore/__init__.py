"""fivefold.explore"""
