"""Whole numbers written in text that comes from outside: a port, a query parameter, a
configured value, an object's name."""

from __future__ import annotations


def is_decimal(text: str) -> bool:
    """Whether text is one or more ASCII digits. str.isdigit alone also takes "¹", which
    int() refuses (a crash where a 400 belongs), and "٣", which int() reads as 3 (another
    spelling of a number that must have one)."""
    return text.isascii() and text.isdigit()
