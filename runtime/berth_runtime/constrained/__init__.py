"""Constrained decoding: output that must match a JSON schema, a regular expression or a grammar."""
