"""Hugging Face transformers models: ``LanguageModel``, its runs and layouts, and the bundled offline models."""
