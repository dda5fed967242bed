"""Sluice's mitmproxy addons. `mitmdump -s addons/sluice_addon.py` loads them all."""
