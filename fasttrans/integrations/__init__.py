"""Integrations with other libraries, each imported on demand.

    import fasttrans.integrations.transformers   # Hugging Face transformers

Importing ``fasttrans`` or this package imports none of those libraries.
"""
