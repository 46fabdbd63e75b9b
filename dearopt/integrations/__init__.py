"""Integrations with other training frameworks: Horovod's API, Lightning, Hugging Face's Trainer."""
