"""Helpers the tests share: real servers on loopback ports."""
