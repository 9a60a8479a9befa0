"""Bridges to other code bases (Hugging Face). Optional dependencies are imported lazily."""
