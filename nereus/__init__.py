"""Nereus: a cost-aware runtime that adapts the parallel layout of RL post-training jobs."""

__version__ = "0.1.0"
