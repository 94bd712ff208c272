"""Conductor: routing, simulation and planning (see issue 6)."""
