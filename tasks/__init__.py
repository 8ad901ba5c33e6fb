"""Thin Prefect tasks, one per stage."""
