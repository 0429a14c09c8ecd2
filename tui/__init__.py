"""`zerod top`: the Textual dashboard, a client of the daemon control API."""
