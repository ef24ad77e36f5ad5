"""MORI: a program-aware router for LLM agent workloads."""

__version__ = "0.1.0"
