"""The recipe: data preparation, features, batches, the training entry point, evaluation and reports."""
