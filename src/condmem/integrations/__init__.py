"""Bridges from condmem to other libraries' models (each in its own subpackage, an optional extra)."""
