"""Exporters render what the core holds; they never call samplers."""
