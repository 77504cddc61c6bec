"""The command line: `s2d SUBCOMMAND` (main.py) over the entry points of infer/ and train/,
and the argument parsing they share (args.py). In an installed wheel the entry points live
here as s2d_jax.cli.infer and s2d_jax.cli.train (pyproject.toml maps the repository's
infer/ and train/ there), so nothing named `infer` or `train` is installed at top level;
from a clone `python -m infer.generate` works as well."""
