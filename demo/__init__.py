"""``kvrouter demo`` and the ``kvrouter`` command.

This package sits above both ``router`` and ``simulator``: the demo starts a simulated fleet
(``simulator.testing``) and routes a load over it through the gateway (``router``), so neither
of those two depends on the other. ``cli`` is the ``kvrouter`` console script; ``run`` is the
demo itself.
"""
