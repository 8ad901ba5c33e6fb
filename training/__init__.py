"""Training library: models, DeepSpeed training, evaluation, export. No Prefect."""
