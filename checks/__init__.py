"""Host probes, the facts snapshot, pure checks over it, and `zerod harden`."""
