"""The data-parallel router that spreads requests over ranks."""
