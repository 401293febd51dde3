"""Checkpoint conversion to AttnRes (installed as `attnres.conversion`)."""
