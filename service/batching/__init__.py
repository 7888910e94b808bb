"""Scheduling: the row shape requests are queued in, their deadlines, and the micro-batcher."""
