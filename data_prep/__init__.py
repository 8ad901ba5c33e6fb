"""Data preparation library: synthetic logs, ingest, preprocess, shard. No Prefect."""
