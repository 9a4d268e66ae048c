"""otbflow: an HPC batch pipeline for RL of language models with variance-reduced baselines."""

__version__ = "0.1.0"
