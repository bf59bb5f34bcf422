"""Generated protobuf modules for the schemas in ``proto/``.

Regenerate with ``python proto/generate.py`` after editing a ``.proto`` file.
"""
