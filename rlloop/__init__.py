"""The orchestrator: config, the driver's loop, Ray placement and actors, rollout scheduling, rewards, tracking.

The only package that imports the others (rollout/, trainer/, weight_sync/) and Ray; they exchange plain arrays and
dataclasses with it.
"""
