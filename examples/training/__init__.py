"""Helpers of examples/train_transformer.py: corpus, progress bar, checkpoints, report."""
