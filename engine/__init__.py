"""The zero-layer inference engine (`zerod serve`). Imports nothing of the daemon."""
