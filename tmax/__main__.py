"""`python -m tmax`: the same as the `tmax` command."""

from tmax.cli.main import app

app(prog_name="tmax")
