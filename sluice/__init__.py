"""Sluice's command line: `sluice proxy`, `sluice policy ...`, `sluice ca`."""
