"""The product benchmark (``python -m scripts.bench``, ``make bench``) and its serving section."""
