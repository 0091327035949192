"""The ``kvrouter`` command: ``serve`` (the gateway), ``demo`` (a simulated fleet under load).

This package sits above ``router``, ``indexer`` and ``simulator``: the demo starts a simulated
fleet (``simulator.testing``) and routes a load over it through the gateway (``router``), so
none of those depends on another the wrong way. ``cli`` is the console script; ``demo`` is the
demo itself, imported only when asked for (``kvrouter serve`` never loads the simulator).
"""
