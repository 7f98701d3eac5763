"""Linear methods: one class per weight format, one registry, chosen once per layer at load (base.py)."""
