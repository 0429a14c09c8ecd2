"""`python -m zerod.bench`: the same command as `zerod bench`."""

from zerod.bench.cli import bench

bench(prog_name="python -m zerod.bench")
