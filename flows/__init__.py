"""recforge pipeline flows, deployments and CLI."""
