"""Forwarding a run's metrics.jsonl to Weights & Biases or MLflow (docs/metrics.md#trackers)."""
