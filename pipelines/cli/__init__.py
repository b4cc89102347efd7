"""The alignpipe command line: one module per command group, registered in main.py."""
