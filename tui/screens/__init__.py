"""Modal screens of `zerod top`: help, details, the signal confirmation."""
