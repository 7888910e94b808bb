"""The model store: version folders, loading engines, running batches, the serving version."""
