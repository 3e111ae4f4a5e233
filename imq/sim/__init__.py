"""``imq simulate``: a seeded collating network on one queue, verified exactly-once.

The library never prints; :mod:`imq.cli.simulate` draws the progress bar and the report.
"""

from imq.sim.engine import (
    SimConfig,
    SimQueue,
    SimResult,
    Simulation,
    SimulationError,
    Violation,
)

__all__ = ["SimConfig", "SimQueue", "SimResult", "Simulation", "SimulationError", "Violation"]
