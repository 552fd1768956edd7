"""Serving: which engines can serve a layer list, the export folders, the reference decoder and τ."""
