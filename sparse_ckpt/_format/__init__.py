"""The on-disk format: key grammar, table keys and tags, tensor parts, DSD's nested layout.

The specification is docs/formats.md; these modules implement it.
"""
