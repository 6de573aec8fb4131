"""tmax: one terminal-agent harness to run, benchmark and train."""

__version__ = "0.1.0"
