"""Conductor: cost model, routing policies, discrete-event simulator, pool planner, live router.

Reads the kvstore block index; never imported by kvstore's core.
"""
