"""Reason codes: occlusion contributions computed with the score, and the manifest's codes."""
