"""Where a run's numbers go: the terminal and train.log, metrics.jsonl's logging backends (TensorBoard, wandb, MLflow) and the SVG plots."""

__all__ = []  # (import its modules)
