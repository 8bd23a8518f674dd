"""Decoupled DiLoCo: many independent learners, one central syncer, one model."""

__version__ = "0.1.0"
