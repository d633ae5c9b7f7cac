"""Model implementations and the loader that finds and reads their weights."""
